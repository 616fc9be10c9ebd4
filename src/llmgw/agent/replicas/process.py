"""A replica's engine process as the node sees it: the record that survives the agent (pid,
port, key, placement), its command line and environment (what holds it to its GPUs),
whether a pid is still it, and its stop (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import json
import logging
import os
import resource
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from llmgw.contract import CPU_ENGINE, CUDA_ENGINE
from llmgw.contract.records import Assignment, Gpu, SplitMain, SplitShare, SplitWorker

ENGINE_NAME = "llama-server"
RPC_SERVER_NAME = "rpc-server"
STOP_GRACE_S = 10.0


@dataclass
class Record:
    """What survives the agent: enough to find, check and stop a running engine."""

    id: str
    model: str
    profile: str
    source: str
    sha256: str
    args: list[str]
    weights: str = ""
    pid: int = 0
    port: int = 0
    api_key: str = ""
    # The engine it runs on (llamacpp, llamacpp-cuda) and its GPUs (NVML UUIDs, in order;
    # none for a CPU profile). Absent from a record written before GPUs were placed.
    engine: str = CPU_ENGINE
    gpus: list[str] = field(default_factory=list)
    # A replica split over nodes: this node's part as the assignment said it (SplitMain or
    # SplitShare; empty for a replica on one node). On a worker, pid and port are
    # rpc-server's (port on 127.0.0.1) and relay_port its relay's on the management address.
    split: SplitMain | SplitShare | None = None
    relay_port: int = 0

    @property
    def role(self) -> str:
        """main, worker, or '' for a replica on one node."""
        return self.split["role"] if self.split else ""

    @property
    def main_node(self) -> str:
        """A worker's main node (the one its relay admits); '' elsewhere."""
        return self.split["main"] if self.split and self.split["role"] == "worker" else ""

    @property
    def workers(self) -> list[SplitWorker]:
        """A main's workers, in the order its engine numbers them; [] elsewhere."""
        return list(self.split["workers"]) if self.split and self.split["role"] == "main" \
            else []

    @property
    def main_layers(self) -> int | None:
        """The layers a GPU main keeps on its own cards; None where not said (a CPU main,
        or a control plane older than GPU splits over nodes)."""
        if self.split and self.split["role"] == "main" and "layers" in self.split:
            return self.split["layers"]
        return None

    @property
    def process_name(self) -> str:
        """What pid runs: rpc-server on a worker, else llama-server."""
        return RPC_SERVER_NAME if self.role == "worker" else ENGINE_NAME


_LAYERS_FLAGS = ("-ngl", "--gpu-layers", "--n-gpu-layers")
# Every layer: llama.cpp caps it at the model's layer count.
ALL_LAYERS = "999"


def engine_for(assignment: Assignment) -> str:
    """The engine a replica runs on: one placed on GPUs needs llama.cpp built with CUDA,
    whatever engine its profile names (profiles name the engine family, `llamacpp`)."""
    return CUDA_ENGINE if assignment.get("gpus") else assignment.get("engine") or CPU_ENGINE


def placement(gpus: list[str], known: list[Gpu],
              args: Sequence[str] = ()) -> tuple[list[str], dict[str, str]]:
    """The flags and environment that hold an engine to its GPUs, or to the CPU alone.

    With GPUs: CUDA_VISIBLE_DEVICES names them by UUID (so the engine sees those and no
    other, numbered CUDA0.. in that order), --device names all it sees and every layer is
    offloaded unless the profile's args say how many. Without: no GPU visible, --device
    none and no layer offloaded, since llama.cpp otherwise offloads to any GPU it finds.
    A UUID this node's NVML did not report is refused: the engine would start elsewhere."""
    layers_given = any(a in _LAYERS_FLAGS for a in args)
    if not gpus:
        return (["--device", "none", *([] if layers_given else ["--n-gpu-layers", "0"])],
                {"CUDA_VISIBLE_DEVICES": ""})
    here = {str(g.get("uuid", "")) for g in known}
    missing = [u for u in gpus if u not in here]
    if missing:
        raise ValueError(f"the control plane placed this replica on {', '.join(missing)}, "
                         f"which this node does not have (its GPUs: "
                         f"{', '.join(sorted(here)) or 'none'}); the next heartbeat corrects "
                         "the placement")
    devices = ",".join(f"CUDA{i}" for i in range(len(gpus)))
    return (["--device", devices, *([] if layers_given else ["--n-gpu-layers", ALL_LAYERS])],
            {"CUDA_VISIBLE_DEVICES": ",".join(gpus)})


def command(engine: str, record: Record, bind_host: str, args: list[str],
            flags: list[str]) -> list[str]:
    """The engine's command line: its model, listener and key, then its args, then the
    placement's flags. --metrics: the control plane scrapes each ready replica's /metrics.
    The placement comes last: llama.cpp takes the last --device, and the catalog's may not
    override the GPUs the scheduler counted."""
    return [engine, "-m", record.weights, "--host", bind_host, "--port", str(record.port),
            "--api-key", record.api_key, "--metrics", *args, *flags]


# Where NCCL and Gloo bootstrap their collectives: the management interface, unless the
# agent was started with its own choice.
SOCKET_IFNAME = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


def environment(devices: dict[str, str], interface: str) -> dict[str, str]:
    """The engine's environment: this process's, the placement's devices, and the
    management interface for NCCL and Gloo where the node names one. A NCCL_SOCKET_IFNAME
    or GLOO_SOCKET_IFNAME already set for the agent is kept: whoever set it chose an
    interface (an InfiniBand one, a list, a `^` exclusion) the node cannot know better."""
    env = {**os.environ, **devices}
    if interface:
        for name in SOCKET_IFNAME:
            env.setdefault(name, interface)
    return env


def preset_socket_ifnames() -> dict[str, str]:
    """NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME as set for the agent (kept for engines)."""
    return {name: os.environ[name] for name in SOCKET_IFNAME if os.environ.get(name)}


_memlock_said = False


def _limit_words(n: int) -> str:
    return "unlimited" if n == resource.RLIM_INFINITY else f"{n // 1024} KiB"


def raise_memlock() -> str:
    """Lift this process's locked-memory limit (RLIMIT_MEMLOCK), which every engine it starts
    inherits, as far as it may: to unlimited where it may raise the hard limit (root with
    CAP_SYS_RESOURCE), else the soft limit to the hard one. What was done, or why it stays
    below unlimited; '' when it already was unlimited.

    RDMA pins the buffers NCCL registers: under a small limit (8 MiB is common) an engine
    fails its first collective over InfiniBand. The systemd unit sets LimitMEMLOCK=infinity;
    local mode (supervisord) sets nothing, so the agent raises it itself."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    unlimited = resource.RLIM_INFINITY
    if soft == unlimited:
        return ""
    try:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (unlimited, unlimited))
        return f"raised the engines' locked-memory limit from {_limit_words(soft)} to unlimited"
    except (ValueError, OSError):
        pass
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (hard, hard))
    who = "root without CAP_SYS_RESOURCE" if os.geteuid() == 0 else f"uid {os.geteuid()}"
    return (f"engines may lock {_limit_words(hard)} of memory at most (RLIMIT_MEMLOCK, "
            f"raised from {_limit_words(soft)} to its hard limit, which this agent, as {who}, "
            "may not raise): NCCL over InfiniBand/RDMA pins what it registers and fails "
            "beyond that; run the agent under systemd (the llmgw-agent unit sets "
            "LimitMEMLOCK=infinity) or raise the hard limit where it starts (`ulimit -l "
            "unlimited` as root, /etc/security/limits.conf)")


def memlock_for_engines(log: logging.Logger) -> None:
    """raise_memlock(), said in the agent's log the first time only."""
    global _memlock_said
    said = raise_memlock()
    if said and not _memlock_said:
        _memlock_said = True
        (log.info if said.startswith("raised") else log.warning)("memlock: %s", said)


def spawn(argv: list[str], env: dict[str, str], log_path: Path,
          log: logging.Logger) -> subprocess.Popen[bytes]:
    """Start an engine: its output appended to log_path, in its own session (it outlives the
    agent and is adopted again), with the locked-memory limit raised first."""
    memlock_for_engines(log)
    with open(log_path, "ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)


def pid_is_engine(pid: int, port: int, name: str = ENGINE_NAME) -> bool:
    """Whether pid is alive (not a zombie) and is a llama-server (or name) on port."""
    if pid <= 0:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    if stat.rsplit(")", 1)[-1].split()[0] in ("Z", "X"):
        return False
    words = [a.decode(errors="replace") for a in argv]
    # Two words: the prebuilt engine's launcher is a script, run as `python .../llama-server`.
    return any(w.endswith(name) for w in words[:2]) and str(port) in words


def terminate(pid: int, port: int, proc: subprocess.Popen[bytes] | None = None,
              name: str = ENGINE_NAME, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the engine (or the name process on port), SIGKILL it after grace_s (at once
    for 0)."""
    if not pid_is_engine(pid, port, name):
        return
    os.kill(pid, signal.SIGTERM if grace_s > 0 else signal.SIGKILL)
    deadline = time.monotonic() + grace_s
    while pid_is_engine(pid, port, name) and time.monotonic() < deadline:
        if proc is not None:
            proc.poll()
        time.sleep(0.1)
    if pid_is_engine(pid, port, name):
        os.kill(pid, signal.SIGKILL)
    if proc is not None:
        proc.wait(timeout=5)


def stop_engines(state_dir: Path) -> list[str]:
    """Stop every engine recorded under state_dir (used by `llmgw down`)."""
    stopped = []
    for path in sorted((Path(state_dir) / "replicas").glob("*.json")):
        try:
            record = read_record(path)
        except (OSError, ValueError, TypeError):
            continue
        if pid_is_engine(record.pid, record.port, record.process_name):
            terminate(record.pid, record.port, name=record.process_name)
            stopped.append(f"{record.id} (pid {record.pid})")
        path.unlink(missing_ok=True)
    return stopped


def read_record(path: Path) -> Record:
    """A record as the supervisor wrote it; OSError, ValueError or TypeError when it cannot
    be read back."""
    return Record(**json.loads(path.read_text()))
