"""The replica supervisor, one job: this node's replicas held to what the control plane
assigns, through their lifecycle (downloading, starting, ready, failed with backoff, given
up, retired, adopted again after the agent restarts). What it drives lives beside it: the
weights (llmgw.agent.replicas._weights), the engine's process and record
(llmgw.agent.replicas.process), its probes (llmgw.agent.replicas._probe), its slots
(llmgw.agent.sizing).

A replica placed on GPUs whose engine exits before it is ever ready GPU_START_ATTEMPTS
times in a row (out of memory while loading, a CUDA error) is given up: not started again,
and reported (`given_up` in the heartbeat, with the reason read from the engine's log) for
GIVE_UP_FOR_S (llmgw.agent.replicas._giveups), so the control plane places the model on its next
profile meanwhile.

Each replica's pid, port and key live in STATE/replicas/ID.json, written before the
engine is considered started, so an agent that comes back (kill -9, upgrade) finds its
engines still serving and adopts them instead of starting second copies.

A replica split over nodes (its assignment's `split`) is this node's part of it: on a
worker, rpc-server and its relay (llmgw.agent.replicas.split.WorkerShare), ready with the
relay's port, no weights fetched (the main node sends them over RPC); on the main node,
the relays to the workers (MainShare) and llama-server with --rpc through them. llama.cpp's
RPC has no failover, so a split replica that loses a part (a worker lost, rpc-server or the
engine exited) is failed for good here: its engine and share are stopped and the control
plane places it again, under a new id. For the same reason it is not adopted after an
agent restart (its relays ended with the previous agent): what was left is stopped.
"""

from __future__ import annotations

import json
import logging
import secrets
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from llmgw import httpclient
from llmgw.agent import sizing
from llmgw.agent.replicas import _probe, _weights, rpc_argv
from llmgw.agent.replicas import log as engine_log
from llmgw.agent.replicas._giveups import GIVE_UP_FOR_S, GiveUps, given_up
from llmgw.agent.replicas.process import (
    STOP_GRACE_S,
    Record,
    command,
    engine_for,
    environment,
    pid_is_engine,
    placement,
    read_record,
    spawn,
    terminate,
)
from llmgw.agent.replicas.split import MainShare, WorkerShare
from llmgw.agent.revocation import Revocations
from llmgw.agent.rpc_relay import Worker
from llmgw.config import TLSFiles
from llmgw.contract import ReplicaState
from llmgw.contract.records import (
    Assignment,
    Gpu,
    Inventory,
    ReplicaReport,
    StateChanges,
    reported,
)
from llmgw.host.files import atomic_write, last_lines
from llmgw.host.netaddr import free_port
from llmgw.model.engine_args import check_engine_args

log = logging.getLogger("llmgw.replicas")

MAX_BACKOFF_S = 30.0
_LOG_TAIL = 8
# How far back the engine's log is read for why a start failed.
_REASON_LINES = 200
# A ready replica leaves ready on a refused connection or an exit at once, but only after
# this many slow or failed probes in a row: under load a probe waits behind generations,
# and one slow answer said nothing about whether the engine serves.
PROBE_FAILURES_TO_LEAVE = 3
PROBE_TIMEOUT_S = 5.0
MAX_PROBES_AT_ONCE = 16
# A replica on GPUs is given up after this many failed starts in a row (each an engine that
# exited before it was ever ready), with the backoff above between them: 1 s, then 2 s.
GPU_START_ATTEMPTS = 3
NO_RPC_BACKEND = ("this node's {engine} engine has no RPC backend (no rpc-server beside its "
                  "llama-server {path}), so it cannot hold a share of a split replica: set "
                  "engine.prebuilt: off in agent.yaml (and no engine.llama_server) so the "
                  "agent builds llama.cpp with it, then restart the agent")


@dataclass
class Replica:
    record: Record
    state: ReplicaState = ReplicaState.DOWNLOADING
    err: str = ""
    proc: subprocess.Popen[bytes] | None = None
    failures: int = 0
    retry_at: float = 0.0
    probe_failures: int = 0
    # Engines started since it was last ready that exited before being ready; given up
    # (never started again) once GPU_START_ATTEMPTS of them ran on GPUs.
    failed_starts: int = 0
    gave_up: bool = False
    # state -> how many times the replica entered it: a flap cannot hide between two polls.
    changes: dict[str, int] = field(default_factory=dict)
    worker: threading.Thread | None = field(default=None, repr=False)
    # A split replica's part on this node: its relays (and rpc-server on a worker).
    share: WorkerShare | MainShare | None = field(default=None, repr=False)
    # A split replica that lost a part: failed for good here (see the module's docstring).
    ended: bool = False


class ReplicaSupervisor:
    """Runs this node's replicas; the agent calls report() and reconcile() every heartbeat."""

    def __init__(
        self,
        *,
        state_dir: Path,
        weights_dir: Path,
        engine: Callable[[str], str | None],
        bind_host: str,
        rpc_server: Callable[[str], str | None] = lambda kind: None,
        tls: TLSFiles | None = None,
        revocations: Callable[[], Revocations | None] = lambda: None,
        interface: str = "",
        gpus: list[Gpu] | None = None,
        clock: Callable[[], float] = time.monotonic,
        http: httpx.Client | None = None,
        probe_timeout_s: float = PROBE_TIMEOUT_S,
        cards: Callable[[], list[Gpu]] | None = None,
        gpu_start_attempts: int = GPU_START_ATTEMPTS,
        give_up_for_s: float = GIVE_UP_FOR_S,
    ) -> None:
        self.dir = Path(state_dir) / "replicas"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.weights_dir = Path(weights_dir)
        # engine(kind): the path of that engine's llama-server once it is ready, else None.
        self.engine = engine
        # rpc_server(kind): that engine's rpc-server once it is ready, None where it has
        # none; tls: the node's certificates, which the split replicas' relays present.
        self.rpc_server = rpc_server
        self.tls = tls
        # The cluster's revocation list as the agent keeps it (None before it has one):
        # the relays refuse, and close, a revoked peer.
        self.revocations = revocations
        self.gpus: list[Gpu] = list(gpus or [])
        # The cards as they are now (free memory from NVML): a GPU replica is sized by them.
        self.cards = cards or (lambda: self.gpus)
        self.bind_host = bind_host
        self.interface = interface
        self.clock = clock
        self.http = http or httpclient.client(timeout=httpx.Timeout(30.0, read=300.0))
        self.probe_timeout_s = probe_timeout_s
        # 0: never give a GPU placement up (restarted with backoff, as a CPU one is).
        self.gpu_start_attempts = gpu_start_attempts
        self.give_up_for_s = give_up_for_s
        # Placements given up, reported for give_up_for_s.
        self.give_ups = GiveUps(give_up_for_s, clock)
        self.replicas: dict[str, Replica] = {}
        # Replicas stopping in the background (stop()), until their engine is gone.
        self.retiring: dict[str, threading.Thread] = {}
        self._lock = threading.RLock()
        self.adopt()

    # --- the seam the agent uses ---

    def loading(self) -> bool:
        with self._lock:
            return any(r.state in (ReplicaState.DOWNLOADING, ReplicaState.STARTING)
                       for r in self.replicas.values())

    def report(self) -> list[ReplicaReport]:
        self.watch()
        with self._lock:
            return [self._report(r) for r in self.replicas.values()]

    def _report(self, r: Replica) -> ReplicaReport:
        """One replica's report; a worker's share has no endpoint, but its relay's port
        while it is ready."""
        worker = r.record.role == "worker"
        report: ReplicaReport = {
            "id": r.record.id,
            "state": reported(r.state),
            "err": r.err,
            "endpoint": self.endpoint(r.record) if r.record.port and not worker else "",
            "api_key": r.record.api_key,
            "pid": r.record.pid,
        }
        if worker and r.state == ReplicaState.READY and r.record.relay_port:
            report["relay_port"] = r.record.relay_port
        return report

    def facts(self) -> Inventory:
        """What the heartbeat carries beside the replicas' states: how often each replica
        changed state (for llmgw_replica_state_changes_total) and the tail of each engine's
        log, kept until the replica is removed (for `llmgw logs`)."""
        with self._lock:
            changes: dict[str, StateChanges] = {
                rid: {"model": r.record.model, "to": dict(r.changes)}
                for rid, r in self.replicas.items()}
        return {"replica_state_changes": changes,
                "replica_logs": engine_log.tails(self.dir),
                "given_up": self.give_ups.current()}

    def warnings(self) -> list[str]:
        """A line per placement given up: which replica, which cards, why, and what then."""
        return self.give_ups.warnings()

    def set_state(self, replica: Replica, state: ReplicaState, why: str = "") -> None:
        """Every change of state is logged with its reason and counted."""
        if state == replica.state:
            replica.err = why
            return
        log.info("replica %s: %s -> %s%s", replica.record.id, replica.state, state,
                 f" ({why})" if why else "")
        replica.changes[state] = replica.changes.get(state, 0) + 1
        replica.state, replica.err = state, why

    def reconcile(self, assignments: list[Assignment]) -> None:
        wanted = {a["id"]: a for a in assignments}
        engine_log.prune(self.dir, set(wanted))
        with self._lock:
            for rid in [rid for rid in self.replicas if rid not in wanted]:
                self.stop(rid)
            for rid, a in wanted.items():
                if rid not in self.replicas:
                    record = Record(id=rid, model=a["model"], profile=a["profile"],
                                    source=a["source"], sha256=a.get("sha256", ""),
                                    args=list(a.get("args", [])),
                                    engine=engine_for(a),
                                    gpus=list(a.get("gpus") or []),
                                    split=a.get("split"))
                    self.replicas[rid] = Replica(record)
                    self._launch(self.replicas[rid])

    # --- adoption ---

    def adopt(self) -> None:
        """Take over engines a previous agent started; forget records whose engine is gone."""
        for path in sorted(self.dir.glob("*.json")):
            try:
                record = read_record(path)
            except (OSError, ValueError, TypeError) as e:
                log.warning("ignoring unreadable replica record %s: %s", path, e)
                continue
            replica = Replica(record, state=ReplicaState.STARTING)
            if record.role:
                self._not_adopted(path, replica)
            elif pid_is_engine(record.pid, record.port):
                # Asked now, so a serving replica is reported ready from the first heartbeat.
                outcome, why = self._health(record)
                self.set_state(replica, ReplicaState.READY if outcome == "ok"
                               else ReplicaState.STARTING, why)
                log.info("adopted replica %s: llama-server pid %d on port %d, %s",
                         record.id, record.pid, record.port, replica.state)
            else:
                # Its engine died while no agent watched; start it again.
                self.set_state(replica, ReplicaState.FAILED,
                               "the engine was gone when the agent started")
                replica.retry_at = self.clock()
            self.replicas[record.id] = replica

    def _not_adopted(self, path: Path, replica: Replica) -> None:
        """A split replica's part left by a previous agent: its relays ended with that
        agent, so its engine or rpc-server serves nothing. Stopped, and the replica failed
        for good (the control plane places it again)."""
        record = replica.record
        left = pid_is_engine(record.pid, record.port, record.process_name)
        if left:
            terminate(record.pid, record.port, name=record.process_name)
        path.unlink(missing_ok=True)
        why = (f"the agent restarted while this node held the {record.role} part of a split "
               "replica; its relays ended with the previous agent, so it is not adopted"
               + (f" (stopped the {record.process_name} left running, pid {record.pid})"
                  if left else ""))
        log.warning("replica %s: %s", record.id, why)
        self.set_state(replica, ReplicaState.FAILED, why)
        replica.ended = True

    # --- lifecycle ---

    def endpoint(self, record: Record) -> str:
        host = f"[{self.bind_host}]" if ":" in self.bind_host else self.bind_host
        return f"http://{host}:{record.port}"

    def _launch(self, replica: Replica) -> None:
        replica.worker = threading.Thread(
            target=self._prepare_and_start, args=(replica,), name=f"replica-{replica.record.id}",
            daemon=True,
        )
        replica.worker.start()

    def _prepare_and_start(self, replica: Replica) -> None:
        try:
            if replica.record.role == "worker":
                self.start_worker_share(replica)
                return
            if not replica.record.weights or not Path(replica.record.weights).exists():
                self.set_state(replica, ReplicaState.DOWNLOADING)
                replica.record.weights = str(self.fetch_weights(replica.record))
            self.start_engine(replica)
        except sizing.DoesNotFit as e:
            # Its cards filled since the placement: a failed start, so that after
            # GPU_START_ATTEMPTS the placement is given up and placed on cards that fit.
            log.warning("replica %s failed: %s", replica.record.id, e)
            replica.failed_starts += 1
            self._retry_or_give_up(replica, str(e), str(e))
        except Exception as e:  # reported to the control plane, retried with backoff
            log.warning("replica %s failed: %s", replica.record.id, e)
            if replica.share is not None:  # a split part's relays, started before the error
                replica.share.stop()
                replica.share = None
            self._failed(replica, str(e))

    def fetch_weights(self, record: Record) -> Path:
        """The model file, downloaded once into the weights cache and checked."""
        return _weights.fetch(self.http, self.weights_dir, record.source, record.sha256,
                              record.model)

    def start_engine(self, replica: Replica) -> None:
        record = replica.record
        engine = self.engine(record.engine)
        if not engine:
            raise RuntimeError(f"the {record.engine} engine is not ready on this node yet; "
                               "see the node's provision state (`llmgw status`)")
        # Checked again here: the catalog checks too, but the agent runs as root.
        check_engine_args(record.args)
        if record.role == "main":
            flags, devices = self.start_main_share(replica)
        else:
            flags, devices = placement(record.gpus, self.gpus, record.args)
        args = self.sized(record)
        record.port = free_port(self.bind_host)
        record.api_key = secrets.token_urlsafe(24)
        argv = command(engine, record, self.bind_host, args.args, flags)
        env = environment(devices, self.interface)
        # Under the lock: a split replica's relay may report a worker lost (_worker_lost)
        # as soon as the engine dials it.
        with self._lock:
            replica.proc = spawn(argv, env, self.dir / f"{record.id}.log", log)
            record.pid = replica.proc.pid
            atomic_write(self.dir / f"{record.id}.json", json.dumps(asdict(record)),
                         mode=0o600)
            replica.probe_failures = 0
            if not replica.ended:
                self.set_state(replica, ReplicaState.STARTING,
                               "llama-server started, loading the model"
                               + (f"; {args.note}" if args.note else ""))
        log.info("replica %s: started llama-server pid %d on port %d%s", record.id, record.pid,
                 record.port, f" ({args.note})" if args.note else "")

    def _tls(self) -> TLSFiles:
        if self.tls is None or not self.tls.cert:
            raise RuntimeError("a split replica's relay needs this node's TLS files (tls in "
                               "agent.yaml), and this agent was started without them")
        return self.tls

    def start_worker_share(self, replica: Replica) -> None:
        """This node's share of a split replica: rpc-server on loopback and its relay on
        the management address, admitting the assigned main node alone; ready with the
        relay's port."""
        record = replica.record
        if not self.engine(record.engine):
            raise RuntimeError(f"the {record.engine} engine is not ready on this node yet; "
                               "see the node's provision state (`llmgw status`)")
        rpc = self.rpc_server(record.engine)
        if not rpc:
            raise RuntimeError(NO_RPC_BACKEND.format(engine=record.engine,
                                                     path=self.engine(record.engine)))
        check_engine_args(record.args)
        # Its cards alone visible (none on CPU): rpc-server serves every device it sees. A
        # share on cards is the CUDA engine's whatever the assignment named (engine_for).
        _, devices = placement(record.gpus, self.gpus, record.args)
        main = record.main_node
        self.set_state(replica, ReplicaState.STARTING, f"starting rpc-server for main node "
                       f"{main}")
        share = WorkerShare(Path(rpc), self._tls(), host=self.bind_host, main_node=main,
                            profile_args=record.args, log_path=self.dir / f"{record.id}.log",
                            relay_port=record.relay_port,
                            env=environment(devices, self.interface),
                            cards=len(record.gpus), revocations=self.revocations())
        replica.share = share
        record.relay_port = share.start()
        assert share.proc is not None
        replica.proc = share.proc
        record.pid, record.port = share.proc.pid, share.port
        atomic_write(self.dir / f"{record.id}.json", json.dumps(asdict(record)), mode=0o600)
        log.info("replica %s: rpc-server pid %d on %s:%d, its relay on %s:%d admitting %s "
                 "only", record.id, record.pid, "127.0.0.1", share.port, self.bind_host,
                 record.relay_port, main)
        self.set_state(replica, ReplicaState.READY)

    def start_main_share(self, replica: Replica) -> tuple[list[str], dict[str, str]]:
        """The relays to a split replica's workers; the engine's flags for them and its
        environment: on CPU its own layers on this node's CPU (--rpc, the workers' layers
        on their devices, shared by their layers where there are several); on cards, its
        cards alone visible and every layer on a device, the workers' and its own
        (_device_layers)."""
        record = replica.record
        workers = record.workers
        if not workers or any(not w.get("port") for w in workers):
            raise RuntimeError(f"the assignment names workers without their relay's port: "
                               f"{workers}; the control plane sends the main's part once "
                               "every worker reported one")
        # A lost worker makes the engine abort (llama.cpp's RPC has no failover): no
        # debugger attached for a backtrace of that, which holds the stream in flight open.
        env = {"CUDA_VISIBLE_DEVICES": "", "GGML_NO_BACKTRACE": "1"}
        if record.gpus:
            # Its cards by UUID (refused where this node's NVML does not have them); no
            # --device: that would leave the workers' RPC devices out.
            env.update(placement(record.gpus, self.gpus, record.args)[1])
        share = MainShare(self._tls(),
                          [Worker(str(w["node"]), str(w["addr"]), int(w["port"]))
                           for w in workers],
                          sum(int(w["layers"]) for w in workers),
                          ",".join(str(int(w["layers"])) for w in workers),
                          on_lost=lambda w, why: self._worker_lost(replica, w, why),
                          revocations=self.revocations(),
                          device_layers=_device_layers(record) if record.gpus else None)
        replica.share = share
        return share.start(), env

    def _worker_lost(self, replica: Replica, worker: Worker, why: str) -> None:
        """A split replica's main relay lost a worker: the replica fails at once here."""
        self._end_split(replica, f"worker {worker.node} ({worker.host}:{worker.port}) of this "
                        f"split replica was lost: {why}; llama.cpp's RPC has no failover, so "
                        "its engine is stopped and the control plane places it again")

    def _end_split(self, replica: Replica, why: str) -> None:
        """A split replica failed for good: its engine (or rpc-server) and relays stopped
        in the background, the state failed at once."""
        with self._lock:
            if replica.ended:
                return
            replica.ended = True
            self.set_state(replica, ReplicaState.FAILED, why)
        log.warning("replica %s: %s", replica.record.id, why)
        # Killed at once: an engine without its worker serves nothing, and a request in
        # flight must end now, not after a graceful stop's wait.
        threading.Thread(target=self._stop_parts, args=(replica, 0.0),
                         name=f"split-stop-{replica.record.id}", daemon=True).start()

    def _stop_parts(self, replica: Replica, grace_s: float = STOP_GRACE_S) -> None:
        """The replica's engine (rpc-server on a worker) stopped, then its relays."""
        record = replica.record
        terminate(record.pid, record.port, replica.proc, name=record.process_name,
                  grace_s=grace_s)
        if replica.share is not None:
            replica.share.stop()

    def sized(self, record: Record) -> sizing.Sized:
        """A GPU replica's args with its slots sized for its cards' free memory now (its
        engine is not running, so that memory is all it may take); a CPU replica's as they
        are (llama-server's default slots: CPU generation does not gain from more), and so
        are a split main's on cards: its cards hold only their share, which the control
        plane fitted with the workers'."""
        if not record.gpus:
            return sizing.Sized(list(record.args), "")
        if record.role == "main":
            return sizing.Sized(list(record.args), f"split over nodes: its layers on GPU "
                                                   f"{', '.join(record.gpus)} and its workers'")
        return sizing.gpu_args(record.args, Path(record.weights), record.gpus, self.cards())

    def _failed(self, replica: Replica, why: str) -> None:
        self.set_state(replica, ReplicaState.FAILED, why)
        replica.failures += 1
        replica.retry_at = self.clock() + min(MAX_BACKOFF_S, 2.0 ** (replica.failures - 1))

    def _exited(self, replica: Replica, why: str) -> None:
        """The engine is gone: a failed start when it was never ready since it was started;
        the GPU_START_ATTEMPTS-th in a row of a replica on GPUs gives the placement up."""
        if replica.state != ReplicaState.READY:
            replica.failed_starts += 1
        self._retry_or_give_up(replica, why, engine_log.failure_reason(
            engine_log.tail(self.dir / f"{replica.record.id}.log", lines=_REASON_LINES)))

    def _retry_or_give_up(self, replica: Replica, why: str, reason: str) -> None:
        """Failed, retried with backoff; or, at the GPU_START_ATTEMPTS-th failed start in a
        row of a replica on GPUs, the placement given up (reason: the engine's, else why)."""
        if not (replica.record.gpus and 0 < self.gpu_start_attempts <= replica.failed_starts):
            self._failed(replica, why)
            return
        record = replica.record
        reason = reason or why
        self.give_ups.add(given_up(record, reason, replica.failed_starts, self.cards()))
        replica.gave_up = True
        self.set_state(replica, ReplicaState.FAILED,
                       f"given up after {replica.failed_starts} failed starts on GPU "
                       f"{', '.join(record.gpus)}: {reason}")
        log.warning("replica %s of %s: given up on GPU %s after %d failed starts: %s",
                    record.id, record.model, ", ".join(record.gpus), replica.failed_starts,
                    reason)

    def _alive(self, replica: Replica) -> bool:
        if replica.proc is not None:
            return replica.proc.poll() is None
        record = replica.record
        return pid_is_engine(record.pid, record.port, record.process_name)

    def watch(self) -> None:
        """Health of every replica: ready on 200, starting while loading, failed when it died.
        A ready replica that is only slow to answer the probe stays ready (see _probed)."""
        with self._lock:
            replicas = list(self.replicas.values())
        probed: list[Replica] = []
        for r in replicas:
            if (r.worker is not None and r.worker.is_alive()) or r.gave_up or r.ended:
                continue
            if r.state == ReplicaState.FAILED:
                if self.clock() >= r.retry_at:
                    self._launch(r)
                continue
            engine_log.rotate(self.dir / f"{r.record.id}.log")
            if not self._alive(r):
                code = r.proc.returncode if r.proc is not None else "unknown"
                tail = last_lines(self.dir / f"{r.record.id}.log", _LOG_TAIL)
                why = f"{r.record.process_name} exited with code {code}; its last lines: {tail}"
                if r.record.role:
                    self._end_split(r, why)
                else:
                    self._exited(r, why)
                continue
            if r.record.role != "worker":  # a worker's share serves no HTTP to probe
                probed.append(r)
        for r, (outcome, why) in zip(probed, self._probe_all(probed), strict=True):
            self._probed(r, outcome, why)

    def _probe_all(self, replicas: list[Replica]) -> list[tuple[str, str]]:
        """Every replica probed at once: an engine that hangs costs the heartbeat one probe
        timeout, not one for each replica probed after it."""
        if len(replicas) < 2:
            return [self._health(r.record) for r in replicas]
        with ThreadPoolExecutor(max_workers=min(len(replicas), MAX_PROBES_AT_ONCE),
                                thread_name_prefix="llmgw-probe") as pool:
            return list(pool.map(lambda r: self._health(r.record), replicas))

    def _probed(self, r: Replica, outcome: str, why: str) -> None:
        """Apply one probe's outcome: ok, loading (503), refused, or slow (timeout, error)."""
        if outcome == "ok":
            r.probe_failures, r.failures, r.failed_starts = 0, 0, 0
            self.set_state(r, ReplicaState.READY)
        elif outcome in ("loading", "refused"):
            r.probe_failures = 0
            self.set_state(r, ReplicaState.STARTING, why)
        elif r.state != ReplicaState.READY:
            self.set_state(r, r.state, why)
        else:
            r.probe_failures += 1
            if r.probe_failures >= PROBE_FAILURES_TO_LEAVE:
                self.set_state(r, ReplicaState.STARTING, f"{r.probe_failures} health probes in a "
                               f"row failed, the last: {why}")
            else:
                log.info("replica %s: health probe %d of %d failed, still ready: %s",
                         r.record.id, r.probe_failures, PROBE_FAILURES_TO_LEAVE, why)

    def _health(self, record: Record) -> tuple[str, str]:
        return _probe.health(self.http, self.endpoint(record), self.probe_timeout_s)

    def stop(self, rid: str, *, wait: bool = False) -> threading.Thread | None:
        """Stop a replica no longer assigned here, in the background: once the gateway no
        longer sends it requests (it left the table before this node was told), its engine
        finishes those under way (idle, or _probe.RETIRE_DRAIN_S at most), then stops."""
        with self._lock:
            replica = self.replicas.pop(rid, None)
        if replica is None:
            return None
        retiring = threading.Thread(target=self._retire, args=(replica,),
                                    name=f"retire-{rid}", daemon=True)
        # Listed before it starts: a stop that ends at once removes itself from the list.
        self.retiring[rid] = retiring
        retiring.start()
        if wait:
            retiring.join()
        return retiring

    def _retire(self, replica: Replica) -> None:
        record = replica.record
        if replica.state == ReplicaState.READY and record.role != "worker":
            why = self._wait_idle(record)
            log.info("replica %s: %s; stopping its engine", record.id, why)
        self._stop_parts(replica)
        # The log stays for `llmgw logs` until the replica is removed (engine_log.prune).
        (self.dir / f"{record.id}.json").unlink(missing_ok=True)
        self.retiring.pop(record.id, None)
        log.info("replica %s: %s -> stopped (no longer assigned to this node)", record.id,
                 replica.state)

    def _wait_idle(self, record: Record) -> str:
        return _probe.wait_idle(self.http, self.endpoint(record), record.api_key)


def _device_layers(record: Record) -> list[int]:
    """A GPU main's layers a device, in llama.cpp's order of them: each worker's cards (a
    CPU worker is one device), then this node's; each node's layers shared evenly over its
    cards, as the scheduler fitted them (control.scheduler._cards_give)."""
    layers = record.main_layers
    if layers is None:
        raise RuntimeError("the assignment does not say how many layers the main node keeps "
                           "(its control plane is older than GPU splits over nodes); update "
                           "the control plane")
    split: list[int] = []
    for w in record.workers:
        split += rpc_argv.even(int(w["layers"]), max(len(w.get("gpus") or []), 1))
    return split + rpc_argv.even(layers, len(record.gpus))
