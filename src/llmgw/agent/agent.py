"""`llmgw agent`: heartbeats with the node's inventory, its engines provisioned beside them
(the CPU engine first, then, on a node with NVIDIA GPUs, the GPU engine)."""

from __future__ import annotations

import logging
import random
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from llmgw.agent import gpus as gpu_discovery
from llmgw.agent import host
from llmgw.agent.client import AgentClient, NodeRemoved
from llmgw.agent.control_planes import ControlPlanes
from llmgw.agent.engines.cpu import LlamaCpp
from llmgw.agent.engines.cuda import CudaEngine
from llmgw.agent.join import needs_renewal, renewal_request
from llmgw.agent.replicas.process import memlock_for_engines, preset_socket_ifnames
from llmgw.agent.replicas.supervisor import GPU_START_ATTEMPTS, ReplicaSupervisor
from llmgw.agent.revocation import Revocations, kept_fresh
from llmgw.agent.watch import Watch
from llmgw.agent.workload import NoReplicas, Workload
from llmgw.config import AgentConfig
from llmgw.contract import CPU_ENGINE, CUDA_ENGINE, EngineState
from llmgw.contract.records import Gpu, Heartbeat, HeartbeatAnswer, ReplicaReport
from llmgw.errors import APIError, Unreachable

log = logging.getLogger("llmgw.agent")

MAX_BACKOFF_S = 15.0
# A wait never exceeds three heartbeats either: with the node timeout at six (30 s for
# 5 s beats), a node whose control plane restarts is back before its grace runs out.
MAX_BACKOFF_BEATS = 3
# How often the agent looks at its certificate's expiry.
RENEW_CHECK_S = 3600.0
# While a replica downloads or starts, the agent beats at least this often: a request may be
# waiting for it (models on demand), and its readiness is seen at a heartbeat.
LOADING_BEAT_S = 0.5
# While a replica downloads or starts, its state is looked at this often between beats (a
# health probe of its engine on this host): a replica that became ready is reported at once.
LOADING_LOOK_S = 0.1


def backoff_s(heartbeat_s: float, failures: int,
              jitter: Callable[[], float] = random.random) -> float:
    """How long to wait after `failures` heartbeats in a row went unanswered: doubling up
    to MAX_BACKOFF_BEATS heartbeats or MAX_BACKOFF_S, each wait drawn between half and
    all of it.

    A control plane that restarts drops every node at once; drawn waits spread their
    reconnects (a TLS handshake each) instead of bringing them back in one burst."""
    if failures <= 0:
        return heartbeat_s
    ceiling = min(MAX_BACKOFF_S, MAX_BACKOFF_BEATS * heartbeat_s,
                  heartbeat_s * 2 ** min(failures - 1, 8))
    return ceiling * (0.5 + 0.5 * jitter())


class Agent:
    """One node: its inventory, its engine, and what the control plane wants it to run."""

    def __init__(
        self,
        config: AgentConfig,
        *,
        client: AgentClient | None = None,
        engine: LlamaCpp | None = None,
        cuda: CudaEngine | None = None,
        workload: Workload | None = None,
        discover: Callable[[], gpu_discovery.Discovery] = gpu_discovery.discover,
        cards: Callable[[], list[Gpu]] | None = None,
        watch: bool = True,
    ) -> None:
        self.config = config
        self.discovery = discover()
        # The cards as they are now (free and used memory from NVML), read at each heartbeat.
        self.cards = cards or gpu_discovery.LiveCards(self.discovery.gpus).read
        self.control_planes = ControlPlanes(config.server, config.state_dir, config.node_id)
        self.client = client or AgentClient(self.control_planes.current, config.tls,
                                            timeout=config.failover_timeout_s)
        self.engine = engine or LlamaCpp(config.engine, state_dir=Path(config.state_dir))
        self.cuda = cuda or CudaEngine(config.engine, self.discovery, cpu=self.engine)
        self.workload: Workload = workload or NoReplicas()
        self.failures = 0
        self.registered = False
        # Why the control plane refused this node for good ("" while it is a member).
        self.removed = ""
        self._renew_checked = float("-inf")
        # The cluster's revocation list, for the RPC relays of split replicas (run_agent's).
        self.revocations: Revocations | None = None
        # The watch (llmgw.agent.watch): off with watch=False, or for good after a 404.
        self.watch = Watch(lambda: self.config, lambda: self.control_planes.current,
                           lambda: self.failures > 0, lambda: bool(self.removed), on=watch)
        self._sent_replicas: dict[str, str] = {}  # the replicas' states the last beat sent

    @property
    def watching(self) -> bool:
        """Whether this agent holds a watch (off with watch=False, or after a 404)."""
        return self.watch.on

    @watching.setter
    def watching(self, on: bool) -> None:
        self.watch.on = on

    def inventory(self) -> Heartbeat:
        """The heartbeat body (contract.records.Heartbeat); the control plane names the node
        by its cert."""
        interface, addr = host.management_interface(self.config.server,
                                                     self.config.interface)
        statuses = [self.engine.status, self.cuda.status]
        cards = self.cards()
        rpc_engines = [k for k in (CPU_ENGINE, CUDA_ENGINE) if self.rpc_server(k) is not None]
        return {
            "node_id": self.config.node_id,
            "gpus": cards,
            "cpus": host.cpus(),
            "memory_mb": host.memory_mb(),
            "labels": dict(self.config.labels),
            "engines": [s["engine"] for s in statuses if s["state"] == EngineState.READY],
            "provision": statuses,
            "interface": interface,
            "addr": addr,
            "rpc": bool(rpc_engines),
            "rpc_engines": rpc_engines,
            "warnings": [*self.warnings(), *gpu_discovery.lost_card_warnings(cards)],
            "replicas": self._sent(self.workload.report()),
            **self.workload.facts(),
        }

    def rpc_server(self, kind: str) -> Path | None:
        """rpc-server of the engine kind (llamacpp, llamacpp-cuda) once it is ready, None
        where that engine is not ready or has no RPC backend (the prebuilt wheel)."""
        engine = self.cuda if kind == CUDA_ENGINE else self.engine
        return engine.rpc_server if engine.ready() else None

    def _sent(self, reports: list[ReplicaReport]) -> list[ReplicaReport]:
        self._sent_replicas = _replica_states(reports)
        return reports

    def warnings(self) -> list[str]:
        """Discovery's warnings, and the GPU engine's while it is made or when it failed."""
        status = self.cuda.status
        return [*self.discovery.warnings,
                *cuda_warnings(status["state"], status["detail"], status.get("left_out", {})),
                *self.workload.warnings()]

    def renew_if_due(self) -> bool:
        """Renew this node's certificate through the control plane when it expires within
        renew_before_days; returns whether it did."""
        now = time.monotonic()
        if now - self._renew_checked < RENEW_CHECK_S:
            return False
        self._renew_checked = now
        cert = self.config.tls.cert
        if not cert or not Path(cert).is_file():
            return False  # the heartbeat says what is wrong with the TLS files
        if not needs_renewal(cert, self.config.renew_before_days):
            return False
        key_pem, csr = renewal_request(self.config.node_id)
        try:
            self.client.renew(key_pem, csr)
        except APIError as e:
            log.warning("renewing this node's certificate failed: %s; trying again in %.0fs",
                        e, RENEW_CHECK_S)
            return False
        log.info("renewed this node's certificate (%s)", self.config.tls.cert)
        return True

    def beat(self) -> float:
        """One heartbeat; returns how long to wait before the next."""
        self.watch.woken.clear()  # this beat brings whatever the watch saw
        try:
            if self.registered:
                self.renew_if_due()
            self._go_home_if_due()
            answer = self._heartbeat(self.inventory())
        except NodeRemoved as e:
            self.removed = str(e)
            log.error("%s; stopping this node's engines", e)
            self.workload.reconcile([])
            return self.config.heartbeat_s
        except APIError as e:
            self.failures += 1
            if self.failures == 1:
                log.warning("%s; retrying with backoff up to %.0fs", e,
                            backoff_s(self.config.heartbeat_s, 99, lambda: 1.0))
            return backoff_s(self.config.heartbeat_s, self.failures)
        if self.failures:
            log.info("the control plane at %s answers again", self.control_planes.current)
        elif not self.registered:
            log.info("registered with %s as %s", self.control_planes.current,
                     answer.get("node_id"))
        self.registered = True
        self.failures = 0
        self.control_planes.learn(answer)
        self.watch.revised_to(answer.get("revision", ""))
        self.workload.reconcile(list(answer.get("replicas") or []))
        self.cuda.retry_if_cache_changed()
        return self.config.heartbeat_s

    def _heartbeat(self, inventory: Heartbeat) -> HeartbeatAnswer:
        """Send inventory to the current control plane; when it does not answer, to the
        next one in this node's order at once, each known one tried once, and stay with the
        one that answers. Unreachable when none did."""
        for _ in range(len(self.control_planes.order) - 1):
            try:
                return self.client.heartbeat(inventory)
            except Unreachable as e:
                self._move(e)
        return self.client.heartbeat(inventory)

    def _move(self, why: Unreachable) -> None:
        """Move the client to the next control plane in this node's order, in one line
        naming both and why (at debug level while every one is away: the backoff line said
        so already)."""
        was = self.control_planes.current
        to = self.control_planes.next_after(was)
        log.log(logging.DEBUG if self.failures else logging.WARNING,
                "moving from the control plane at %s to %s: %s", was, to, why)
        self.control_planes.left(was, time.monotonic())
        self.client.move_to(to)
        self.control_planes.use(to)

    def _go_home_if_due(self) -> None:
        """Move back to this node's home once its return delay has passed (a control plane
        that joined or came back takes its share of the nodes over a minute); if it does not
        answer, the heartbeat moves on as from any other."""
        home = self.control_planes.due_home(time.monotonic())
        if home is None:
            return
        log.info("moving from the control plane at %s to %s, this node's home",
                 self.control_planes.current, home)
        self.client.move_to(home)
        self.control_planes.use(home)

    def _pause(self, stop: threading.Event, delay_s: float) -> None:
        """Wait delay_s, or less when something is to be said or heard at once: an engine
        or a replica that changed state (a node or a replica that just became ready says
        so now, not a heartbeat later), or new assignments the watch saw."""
        sent = self._states()
        deadline = time.monotonic() + delay_s
        while not stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0 or (self.failures == 0 and self._news(sent)):
                return
            if self.failures:  # away: the backoff alone decides (no watch is held)
                stop.wait(min(left, 0.25))
                continue
            self.watch.woken.wait(min(left, LOADING_LOOK_S if self.workload.loading() else 0.25))

    def _news(self, sent: tuple[str, str]) -> bool:
        """Whether to beat now: the watch woke this agent, an engine's state moved, or a
        replica that loads changed state (its engine's health probed here)."""
        if self.watch.woken.is_set() or self._states() != sent:
            return True
        return self.workload.loading() and \
            _replica_states(self.workload.report()) != self._sent_replicas

    def _sooner_while_loading(self, delay_s: float) -> float:
        """The wait before the next heartbeat: at most LOADING_BEAT_S while a replica loads
        (its engine's readiness is seen and reported then, not a heartbeat_s later; a
        request may be waiting for it), unless the control plane is away (its backoff)."""
        if self.failures == 0 and self.workload.loading():
            return min(delay_s, LOADING_BEAT_S)
        return delay_s

    def _states(self) -> tuple[str, str]:
        return self.engine.status["state"], self.cuda.status["state"]

    def run(self, stop: threading.Event) -> None:
        """Heartbeat until stop is set; the engines are provisioned in the background."""
        for warning in self.discovery.warnings:
            log.warning("%s", warning)
        self.engine.start()
        self.cuda.start()
        watcher = threading.Thread(target=self.watch.run, args=(stop,), name="agent-watch",
                                   daemon=True)
        watcher.start()
        try:
            while not stop.is_set() and not self.removed:
                self._pause(stop, self._sooner_while_loading(self.beat()))
        finally:
            self.watch.release()
            self.cuda.stop()
            self.engine.stop()
            self.client.close()
            # A watch still held ends with its answer or the process (a daemon thread).
            watcher.join(timeout=0.5)


def _replica_states(reports: list[ReplicaReport]) -> dict[str, str]:
    return {r["id"]: r["state"] for r in reports}


# Where a person watches the GPU engine being made (the same words in provision's output).
WATCH_CUDA = "watch it with `llmgw status` or the agent's log"


def cuda_warnings(state: str, detail: str, left_out: dict[str, str] | None = None) -> list[str]:
    """What a person reads of the GPU engine: that it is being made (and where to watch),
    or why it failed; once ready, each card its check left out; nothing where it is not
    wanted."""
    if state == EngineState.READY:
        return [f"GPU {uuid} is left out of the GPU engine ({CUDA_ENGINE}), which serves the "
                f"other cards: {why}" for uuid, why in (left_out or {}).items()]
    if state == EngineState.FAILED:
        return [f"the GPU engine ({CUDA_ENGINE}) failed: {detail}"]
    if state in (EngineState.PENDING, EngineState.DOWNLOADING, EngineState.BUILDING,
                 EngineState.CHECKING):
        return [f"the GPU engine ({CUDA_ENGINE}) is being made ({state}: {detail}); the node "
                f"serves on CPU until it is ready; {WATCH_CUDA}"]
    return []


def replica_supervisor(agent: Agent,
                       gpu_start_attempts: int = GPU_START_ATTEMPTS) -> ReplicaSupervisor:
    """The replicas of this node: engines bound to the address the control plane sees,
    weights cached in the state dir, adopted again when this agent restarts; a placement
    on GPUs given up after gpu_start_attempts failed starts (0: never)."""
    interface, addr = host.management_interface(agent.config.server,
                                                 agent.config.interface)

    def engine_path(kind: str) -> str | None:
        engine = agent.cuda if kind == CUDA_ENGINE else agent.engine
        found = engine.found
        return str(found.path) if engine.ready() and found else None

    def rpc_server_path(kind: str) -> str | None:
        path = agent.rpc_server(kind)
        return str(path) if path else None

    state_dir = Path(agent.config.state_dir)
    return ReplicaSupervisor(state_dir=state_dir, weights_dir=state_dir / "weights",
                             engine=engine_path, rpc_server=rpc_server_path,
                             tls=agent.config.tls, revocations=lambda: agent.revocations,
                             bind_host=addr or "127.0.0.1",
                             interface=interface,
                             gpus=[g.as_dict() for g in agent.discovery.gpus],
                             cards=agent.cards,
                             gpu_start_attempts=gpu_start_attempts)


def run_agent(config: AgentConfig) -> None:
    """Run the agent in this process until SIGTERM or SIGINT."""
    # A line per heartbeat would bury what matters in the agent's log.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    Path(config.state_dir).mkdir(parents=True, exist_ok=True)
    agent = Agent(config)
    agent.workload = replica_supervisor(agent)
    log.info(
        "agent %s: control plane %s (home %s, of %s), %d GPU(s), engine cache %s, "
        "engine.cuda: %s",
        config.node_id, agent.control_planes.current, agent.control_planes.home,
        ", ".join(agent.control_planes.urls),
        len(agent.discovery.gpus), agent.engine.cache_dir, config.engine.cuda,
    )
    interface, _ = host.management_interface(config.server, config.interface)
    kept = preset_socket_ifnames()
    log.info("management interface %s (%s)%s", interface,
             "agent.yaml's interface" if config.interface else "found",
             "".join(f"; {k}={v} set for the agent is kept for its engines"
                     for k, v in kept.items()))
    memlock_for_engines(log)
    agent.revocations = kept_fresh(agent.client.revocation_list, config.tls.ca)
    try:
        agent.run(stop)
    finally:
        agent.revocations.stop()
    log.info("agent stopped")
