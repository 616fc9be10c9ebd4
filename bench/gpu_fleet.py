"""A whole host on a lent GPU machine, end to end: `scripts/gpu-check --fleet` runs this.

    python3 scripts/gpu-check --fleet --out $OUT          (there; carry [".gpu-check"])
    .venv/bin/python scripts/gpu-check --fleet --dry-run --small --out /tmp/fleet   (here)

In one call of at most ten minutes, on a machine that reaches no network:

1. NVML's view (one line and exit 3 where there is no NVIDIA GPU).
2. The random-weight 270M-class GGUF (scripts/gpu-check's writer), and a cache of the
   agent's own (XDG_CACHE_HOME in the run's folder) holding what it would otherwise
   download: the CPU llama-server built where --prepare ran (so only the GPU engine is
   built here) and the packed llama.cpp tree in the sdist's place.
3. `pytest provision/` in local mode (--state-dir in the run's folder, --advertise
   127.0.0.1, free loopback ports, --starter-source file:///<the GGUF>): the starter
   serves on CPU while the agent builds llamacpp-cuda with CudaBuild on the system's CUDA
   toolkit (/usr/local/cuda-13.0 there).
4. Once that build is done (the engine being checked, or ready), 8 clients stream chat
   completions through the gateway until the starter has moved onto its GPU profile and
   each has asked 5 more times: every request that failed is counted (goal 0).
5. Generation tokens/s through the gateway against the same replica's engine called
   directly (its own key), at 1 and at 32 streams in alternating rounds (goal >= 0.95x).
6. The replica's slots as the agent sized them (its command line, `/props` total_slots)
   against llama-server's default slots (the same command line without --parallel, on
   the same card, at --log-verbosity 4 so its loader says what it offloaded), 32 streams
   each in alternating rounds (goal >= 3x).
7. Where NVML lists two GPUs or more: the split. The starter leaves the catalog and the
   same file comes back as `split-check`, its GPU profile with `gpus: 2` and
   `--tensor-split 1,1` (which takes two cards even where one holds it); once ready, its
   engine's command line and CUDA_VISIBLE_DEVICES (/proc) must name the replica's two
   cards with --split-mode layer, and on a GPU NVML must show it holding memory on each
   of them (goal: all of it); its tokens/s at 1 stream, as information.
8. The RPC case (bench/gpu_rpc.py), once the host is down, where RPC_NEEDS_S of the budget
   is left (or alone, with --rpc-only: no host; the newest CUDA build's rpc-server on this
   machine, else one built now): the CPU llama-server carried by --prepare as the main
   engine, the CUDA build's rpc-server (GGML_RPC=ON) as a worker holding the model's last
   half, through the agents' TLS relay with certificates made now; the answer at
   temperature 0 against the unsplit one's, what the rpc-server holds, tokens/s split
   against unsplit (goal: the same answer). Then, where the CUDA build's llama-server is
   beside its rpc-server, the same split with it as the main on this card, as an agent
   runs a GPU profile's split over nodes (rpc_argv.gpu_main_flags): its answer, offload
   and buffers by device (`rpc_gpu_main_*`).

Each step is written to OUT/fleet.json as it ends (a run cut off still says how far it
got); the last line printed is the whole result, also OUT/gpu-check.json. OUT gets at
most 12 files: fleet.json, gpu-check.json, provision.log, agent.log, cuda-build.log,
default-slots.log, nvml.json, rpc-server.log, serve-rpc-unsplit.log, serve-rpc-split.log,
serve-rpc-split-gpu-main.log.

--dry-run ENGINE rehearses all of it on a machine without a GPU: the stand-in NVML
(tests/standin_nvml, two H200s on a CUDA 13.0 driver), provision with --engine-cuda off,
then engine.cuda_server set to a wrapper of the CPU llama-server ENGINE (it drops the GPU
flags) and the agent restarted: the same move, load and measurements, on CPU; the RPC
case's rpc-server is the CPU build's beside ENGINE (its `-rpc` folder's).
"""

from __future__ import annotations

import argparse
import gzip
import importlib.machinery
import importlib.util
import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import gpu_rpc  # noqa: E402
from llmgw.agent.engines.cpu import PINNED_VERSION  # noqa: E402
from llmgw.config import load_server  # noqa: E402
from llmgw.contract import CUDA_ENGINE  # noqa: E402
from llmgw.host.layout import Layout  # noqa: E402
from llmgw.host.netaddr import free_port  # noqa: E402
from llmgw.host.services._supervisor import Supervisor  # noqa: E402
from tests.hosts import ThrowawayHost  # noqa: E402
from tests.loadgen import one_request  # noqa: E402
from tests.standin_cuda_server import H200, standin_cuda_server  # noqa: E402

STANDIN = ROOT / "tests" / "standin_nvml"
# Two cards, so the rehearsal takes the split step too.
STANDIN_H200 = "NVIDIA H200:143771:9.0;NVIDIA H200:143771:9.0"
SPLIT_MODEL = "split-check"
MOVE_CLIENTS = 8
AFTER_MOVE = 5
# The engine states after the build, when the clients start: streams beside the build
# would take the CPUs it needs (the replica on CPU uses them all; the build runs at nice
# 19) and stretch it; the move itself comes after the check, a heartbeat later.
START_AT = ("checking", "ready", "failed")
MAX_TOKENS = 256
# What step 8, the RPC case, takes at most on the device (two loads and two answers of
# the 270M-class model): it runs only with this much of the budget left, or --rpc-only.
RPC_NEEDS_S = 60.0
PROMPT = "Count from one to one hundred, in words, one number a line."


def load_gpu_check() -> ModuleType:
    """scripts/gpu-check as a module (its GGUF writer, its NVML view)."""
    path = str(ROOT / "scripts" / "gpu-check")
    loader = importlib.machinery.SourceFileLoader("gpu_check", path)
    spec = importlib.util.spec_from_loader("gpu_check", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


@dataclass
class Report:
    """The run's result, written to out/fleet.json after every step."""

    out: Path
    started: float = field(default_factory=time.monotonic)
    data: dict[str, Any] = field(default_factory=dict)

    def step(self, name: str, value: Any) -> Any:
        self.data[name] = value
        self.data["elapsed_s"] = round(time.monotonic() - self.started, 1)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "fleet.json").write_text(json.dumps(self.data, indent=2) + "\n")
        print(f"..  {name}: {json.dumps(value)[:300]}", file=sys.stderr, flush=True)
        return value

    def left_s(self, budget_s: float) -> float:
        return budget_s - (time.monotonic() - self.started)


# --- the host ---

def seed_cache(cache: Path, tree: Path, cpu_engine: Path) -> None:
    """The agent's cache as a machine that downloaded nothing has it: the CPU engine built
    where --prepare ran, and the packed llama.cpp tree where the sdist would be (CudaBuild
    unpacks either and finds the tree in it)."""
    engine = cache / "llmgw" / "engines" / "llamacpp" / PINNED_VERSION / "llama-server"
    engine.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(cpu_engine, "rb") as f, open(engine, "wb") as out:
        shutil.copyfileobj(f, out)
    engine.chmod(0o755)
    sources = cache / "llmgw" / "sources"
    sources.mkdir(parents=True, exist_ok=True)
    shutil.copy2(tree, sources / f"llama_cpp_python-{PINNED_VERSION}.tar.gz")


def standin_gpu_engine(directory: Path, real: str) -> Path:
    """llamacpp-cuda stood in for by the CPU llama-server (tests/standin_cuda_server.py):
    --list-devices names the stand-in's H200; --device and --n-gpu-layers dropped."""
    return standin_cuda_server(directory, real=real, card=H200)[0]


def engine_states(host: ThrowawayHost) -> dict[str, dict[str, str]]:
    nodes = httpx.get(f"{host.admin_url}/api/v1/nodes", headers=host.auth, timeout=10).json()
    return {p["engine"]: {"state": p["state"], "detail": p.get("detail", "")}
            for node in nodes for p in node.get("provision", [])}


def live_replicas(host: ThrowawayHost) -> list[dict[str, Any]]:
    replicas = httpx.get(f"{host.admin_url}/api/v1/replicas", headers=host.auth,
                         timeout=10).json()
    return [r for r in replicas if r["state"] != "stopped"]


def on_gpu(replicas: list[dict[str, Any]]) -> bool:
    """Only GPU-profile replicas are live, and one of them is ready."""
    return bool(replicas) and all(r["profile"].startswith("gpu") for r in replicas) \
        and any(r["state"] == "ready" for r in replicas)


# --- load ---

@dataclass
class Side:
    """One way to the replica's engine: a base URL and the bearer key it takes."""

    name: str
    url: str
    key: str


def body(model: str, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}


def streamed_tokens(client: httpx.Client, payload: dict[str, Any]) -> int:
    """One streamed chat completion: the tokens generated (its usage, else its chunks);
    raises RuntimeError for anything but a whole stream."""
    chunks, usage = 0, 0
    with client.stream("POST", "/v1/chat/completions", json={**payload, "stream": True}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read()[:200]!r}")
        done = False
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                continue
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"the stream broke off: {event['error']}")
            usage = (event.get("usage") or {}).get("completion_tokens") or usage
            chunks += any((c.get("delta") or {}).get("content") for c in event.get("choices", []))
    if not done:
        raise RuntimeError("the stream ended without [DONE]")
    return usage or chunks


def throughput(side: Side, payload: dict[str, Any], width: int, seconds: float) -> dict:
    """width clients streaming back to back for about seconds: generated tokens/s over
    the wall time until the last one finished, and the requests that failed."""
    tokens, failed, done = [0] * width, [0] * width, [0] * width
    errors: list[str] = []
    deadline = time.monotonic() + seconds

    def client(i: int) -> None:
        headers = {"Authorization": f"Bearer {side.key}"} if side.key else {}
        # A connection per request: llama-server closes kept-alive ones at will (its
        # HTTP library), which a reused connection meets as a request never answered.
        with httpx.Client(base_url=side.url, headers=headers, timeout=120,
                          limits=httpx.Limits(max_keepalive_connections=0)) as http:
            while True:  # one request at least, then until the deadline
                try:
                    tokens[i] += streamed_tokens(http, payload)
                    done[i] += 1
                except (httpx.HTTPError, RuntimeError, ValueError) as e:
                    failed[i] += 1
                    errors.append(f"{type(e).__name__}: {e}"[:300])
                if time.monotonic() >= deadline:
                    return

    started, cpu = time.monotonic(), time.process_time()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(width)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - started
    # The load's own CPU share: near 1.0, this process (one GIL) bounds what it measures.
    return {"tokens_per_s": round(sum(tokens) / wall, 1), "requests": sum(done),
            "failed": sum(failed), "errors": errors[:3],
            "client_cpu": round((time.process_time() - cpu) / wall, 2)}


def rounds(sides: list[Side], payload: dict[str, Any], width: int, seconds: float,
           count: int) -> dict[str, Any]:
    """count rounds of each side back to back, the first side turning each round; the
    median tokens/s of each, and the ratio of the second to the first."""
    runs: dict[str, list[dict]] = {s.name: [] for s in sides}
    for side in sides:  # one answer each first: the prompt cached, the engine warm
        throughput(side, payload, 1, 0.0)
    for n in range(count):
        for side in (sides if n % 2 == 0 else sides[::-1]):
            runs[side.name].append(throughput(side, payload, width, seconds))
    medians = {name: statistics.median(r["tokens_per_s"] for r in got)
               for name, got in runs.items()}
    first, second = (s.name for s in sides)
    return {"streams": width, "rounds": count,
            **{f"{name}_tokens_per_s": round(m, 1) for name, m in medians.items()},
            "failed": sum(r["failed"] for got in runs.values() for r in got),
            "errors": [e for got in runs.values() for r in got for e in r["errors"]][:3],
            "client_cpu": max(r["client_cpu"] for got in runs.values() for r in got),
            "ratio": round(medians[second] / medians[first], 3) if medians[first] else None}


def move_under_load(host: ThrowawayHost, model: str, limit_s: float) -> dict[str, Any]:
    """MOVE_CLIENTS clients streaming through the gateway until the starter is on its GPU
    profile and each has asked AFTER_MOVE more times: the requests that failed."""
    outcomes: list[str] = []
    lock = threading.Lock()
    moved = threading.Event()
    stop = threading.Event()
    deadline = time.monotonic() + limit_s
    payload = body(model, 32)

    def client() -> None:
        after = 0
        headers = {"Authorization": f"Bearer {host.gateway_key}"}
        url = f"http://127.0.0.1:{host.ports['gateway']}"
        with httpx.Client(base_url=url, headers=headers, timeout=120) as http:
            while not stop.is_set() and time.monotonic() < deadline and after < AFTER_MOVE:
                outcome = one_request(http, payload, stream=True)
                with lock:
                    outcomes.append(outcome)
                after += moved.is_set()

    before = [(r["profile"], r["state"]) for r in live_replicas(host)]
    started = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(MOVE_CLIENTS)]
    for t in threads:
        t.start()
    last: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        last = live_replicas(host)
        if on_gpu(last):
            moved.set()
            break
        time.sleep(0.5)
    move_s = round(time.monotonic() - started, 1)
    for t in threads:
        t.join(max(1.0, deadline - time.monotonic()) + 130)
    stop.set()
    failed = [o for o in outcomes if o]
    # Under load only where a CPU replica still served when the clients began.
    return {"clients": MOVE_CLIENTS, "before": before, "moved": moved.is_set(),
            "under_load": any(profile == "cpu" for profile, _ in before),
            "move_s": move_s, "after": [(r["profile"], r["state"]) for r in last],
            "requests": len(outcomes), "failed": len(failed), "failures": failed[:3]}


# --- the replica and its engine ---

def ready_replica(host: ThrowawayHost, model: str = "") -> dict[str, Any]:
    """The ready GPU replica's row (of model, where given: endpoint, its own key, its
    GPUs), read-only from the store."""
    config = load_server(Layout.for_mode("local", host.state_dir).server_yaml)
    db_path = Path(config.state_dir) / "control.db"
    with sqlite3.connect(f"file:{db_path}?mode=ro", uri=True) as db:
        db.row_factory = sqlite3.Row
        rows = [dict(r) for r in db.execute(
            "SELECT id, model, profile, endpoint, api_key, gpus FROM replicas "
            "WHERE state = 'ready'")]
    gpu = [r for r in rows if r["profile"].startswith("gpu") and model in ("", r["model"])]
    if not gpu:
        raise RuntimeError(f"no ready GPU replica in the store: {rows}")
    return gpu[0]


def engine_argv(port: int) -> tuple[int, list[str]]:
    """The llama-server serving on a local port (its --port), and its command line, from
    /proc/*/cmdline (which gVisor, where the device runs, has as Linux does)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = [a.decode() for a in (proc / "cmdline").read_bytes().split(b"\0") if a]
        except OSError:
            continue
        if argv and Path(argv[0]).name == "llama-server" and flag(argv, "--port") == str(port):
            return int(proc.name), argv
    raise RuntimeError(f"no llama-server with --port {port} among this machine's processes")


def engine_env(pid: int, name: str) -> str | None:
    """One variable of a process's environment (/proc/PID/environ), None where unset."""
    for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        key, _, value = entry.decode(errors="replace").partition("=")
        if key == name:
            return value
    return None


def split_spec(starter: dict[str, Any]) -> dict[str, Any]:
    """The starter's file as SPLIT_MODEL: its GPU profile alone, on two cards, 1:1."""
    profile = next(p for p in starter["profiles"] if p.get("gpu_class"))
    return {"name": SPLIT_MODEL, "source": starter["source"], "sha256": starter["sha256"],
            "profiles": [{**profile, "name": "gpu-split", "gpus": 2,
                          "args": [*profile.get("args", []), "--tensor-split", "1,1"]}]}


def split_over_two(host: ThrowawayHost, dry_run: bool, limit_s: float,
                   seconds: float) -> dict[str, Any]:
    """Step 7: the starter's file split over two cards; what its engine was given and
    what its loader says it put where (module docstring)."""
    admin, auth = f"{host.admin_url}/api/v1", host.auth
    starter = httpx.get(f"{admin}/models", headers=auth, timeout=10).json()[0]
    httpx.delete(f"{admin}/models/{starter['name']}", headers=auth, timeout=10)
    added = httpx.post(f"{admin}/models", headers=auth, json=split_spec(starter), timeout=30)
    if added.status_code != 201:
        return {"ok": False, "why": f"adding {SPLIT_MODEL}: {added.status_code} {added.text}"}
    deadline, mine = time.monotonic() + limit_s, []
    while time.monotonic() < deadline:
        mine = [r for r in live_replicas(host) if r["model"] == SPLIT_MODEL]
        if any(r["state"] == "ready" for r in mine):
            break
        time.sleep(0.5)
    else:
        return {"ok": False, "why": f"{SPLIT_MODEL} not ready within {limit_s:.0f} s: {mine}"}
    replica = ready_replica(host, SPLIT_MODEL)
    gpus = json.loads(replica["gpus"] or "[]")
    pid, argv = engine_argv(int(replica["endpoint"].rsplit(":", 1)[1]))
    found = {"gpus": gpus, "cuda_visible_devices": engine_env(pid, "CUDA_VISIBLE_DEVICES"),
             "split_mode": flag(argv, "--split-mode", "-sm"),
             "tensor_split": flag(argv, "--tensor-split", "-ts"),
             "device_flag": flag(argv, "--device", "-dev"),
             "held_mib_by_card": gpu_memory_by_card(pid)}
    side = Side("split", replica["endpoint"], replica["api_key"])
    found["tokens_per_s_1"] = throughput(side, body(SPLIT_MODEL), 1, seconds).get(
        "tokens_per_s")
    found["ok"] = split_ok(found, dry_run)
    return found


def split_ok(found: dict[str, Any], dry_run: bool) -> bool:
    """The engine on the replica's two cards, split layer-wise 1:1; on a GPU, NVML has it
    holding memory on each of the two (the rehearsal's CPU engine holds none)."""
    gpus = found.get("gpus") or []
    held = found.get("held_mib_by_card") or {}
    on_both = len(gpus) == 2 and all(held.get(u, 0) > 0 for u in gpus)
    return len(gpus) == 2 and found.get("cuda_visible_devices") == ",".join(gpus) \
        and found.get("split_mode") == "layer" and found.get("tensor_split") == "1,1" \
        and (dry_run or on_both)


def props(side: Side) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {side.key}"} if side.key else {}
    got = httpx.get(f"{side.url}/props", headers=headers, timeout=10).json()
    return {"total_slots": got.get("total_slots"),
            "n_ctx_per_slot": (got.get("default_generation_settings") or {}).get("n_ctx")}


def flag(argv: list[str], *names: str) -> str | None:
    for i, word in enumerate(argv[:-1]):
        if word in names:
            return argv[i + 1]
    return None


def redacted(argv: list[str]) -> list[str]:
    """argv with the replica's key left out (the output travels back)."""
    return [("…" if i and argv[i - 1] == "--api-key" else a) for i, a in enumerate(argv)]


def without(argv: list[str], *names: str) -> list[str]:
    """argv less each of names and the value after it."""
    kept, words = [], iter(argv)
    for word in words:
        if word in names:
            next(words, None)
            continue
        kept.append(word)
    return kept


def _gpu_processes() -> list[tuple[str, int, int]] | None:
    """(card UUID, pid, MiB) for each process NVML lists on each card (None where NVML
    cannot say)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            found: list[tuple[str, int, int]] = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                uuid = pynvml.nvmlDeviceGetUUID(h)
                uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
                found += [(uuid, p.pid, int(p.usedGpuMemory) >> 20)
                          for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)
                          if p.usedGpuMemory is not None]
            return found
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - the stand-in and old drivers have no process list
        return None


def gpu_memory_mib(pids: list[int]) -> dict[str, int] | None:
    """The GPU memory NVML says each pid holds (None where NVML cannot say)."""
    found = _gpu_processes()
    return None if found is None else {str(pid): mib for _, pid, mib in found if pid in pids}


def gpu_memory_by_card(pid: int) -> dict[str, int] | None:
    """The GPU memory NVML says pid holds on each card, by UUID (None where NVML cannot
    say)."""
    found = _gpu_processes()
    return None if found is None else {uuid: mib for uuid, p, mib in found if p == pid}


def start_default(argv: list[str], port: int, log: Path) -> subprocess.Popen[bytes]:
    """The replica's engine with llama-server's default slots: its command line less
    --parallel, on another port, at --log-verbosity 4."""
    cmd = [*without(argv, "--parallel", "-np", "--port", "--log-verbosity", "-lv"),
           "--port", str(port), "--log-verbosity", "4"]
    with open(log, "w") as f:
        f.write("$ " + " ".join(redacted(cmd)) + "\n")
        f.flush()
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)


def wait_health(url: str, proc: subprocess.Popen[bytes], log: Path, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited {proc.returncode}: "
                               + " | ".join(log.read_text().splitlines()[-5:]))
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"llama-server at {url} did not answer /health within {limit_s} s; "
                       f"its log: {' | '.join(log.read_text().splitlines()[-3:])}")


# --- the run ---

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model-shape", required=True, help="the GGUF's shape (JSON)")
    parser.add_argument("--tree", type=Path, required=True, help="the packed llama.cpp tree")
    parser.add_argument("--cpu-engine", type=Path, required=True, help="llama-server, gzipped")
    parser.add_argument("--dry-run", metavar="ENGINE", default="",
                        help="no GPU: the stand-in NVML and this CPU llama-server")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=5.0, help="each round's load")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=530.0,
                        help="the whole run's time; later steps are left out past it")
    parser.add_argument("--keep", action="store_true", help="leave the host up")
    parser.add_argument("--rpc-only", action="store_true",
                        help="only the RPC case (step 8): no host provisioned")
    args = parser.parse_args(argv)
    report = Report(args.out)
    gpu_check = load_gpu_check()
    env = {"PATH": gpu_check.cuda_path(os.environ.get("PATH", ""))}
    if args.dry_run:
        env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(STANDIN),
                                                            os.environ.get("PYTHONPATH")])),
                   LLMGW_STANDIN_GPUS=STANDIN_H200)
        sys.path.insert(0, str(STANDIN))
        os.environ.update(env)
    nvml = report.step("nvml", gpu_check.nvml_view())
    (args.out / "nvml.json").write_text(json.dumps(nvml, indent=2) + "\n")
    absent = [str(f) for f in (args.tree, args.cpu_engine) if not f.is_file()]
    if absent:
        raise SystemExit(f"gpu-check: {' and '.join(absent)} missing: run `scripts/gpu-check "
                         "--prepare` where the checkout's .venv is, and carry .gpu-check")

    work = gpu_check.LOCAL / f"fleet-{time.strftime('%Y%m%d-%H%M%S')}"
    cache = work / "cache"
    seed_cache(cache, args.tree, args.cpu_engine)
    shape = json.loads(args.model_shape)
    model = gpu_check.model_file(shape)
    report.step("model", {"path": str(model), "bytes": model.stat().st_size})
    env["XDG_CACHE_HOME"] = str(cache)
    rc = 0
    if not args.rpc_only:
        host = ThrowawayHost(work / "state")
        try:
            rc = run(args, report, host, model, env, gpu_check)
        finally:
            copy_logs(host, cache, args.out)
            if not args.keep:
                host.down()
    left = report.left_s(args.budget_s)
    if left > RPC_NEEDS_S or args.rpc_only:
        rpc_step(args, report, gpu_check, cache, model, shape, work)
    else:
        report.step("rpc", {"skipped": f"{left:.0f} s of the budget left, under the "
                                       f"{RPC_NEEDS_S:.0f} s it needs: run `scripts/gpu-check "
                                       "--fleet --rpc-only --out DIR` on the same machine"})
    return finish(report, rc)


def rpc_step(args: argparse.Namespace, report: Report, gpu_check: ModuleType, cache: Path,
             model: Path, shape: dict[str, Any], work: Path) -> None:
    """Step 8: the RPC case (bench/gpu_rpc.py), with the CUDA build's rpc-server (the one
    the fleet's agent built; with --rpc-only, the newest one this machine has, else one
    built now) or, rehearsed, the CPU build's beside the --dry-run engine."""
    if args.dry_run:
        rpc_server: Path | None = Path(args.dry_run).parent / "rpc-server"
    else:
        roots = [cache / "llmgw"]
        if args.rpc_only:
            roots += [*sorted(gpu_check.LOCAL.glob("fleet-*/cache/llmgw")), gpu_check.CACHE]
        rpc_server = gpu_rpc.find_rpc_server(roots)
        if rpc_server is None and args.rpc_only:
            gpu_check.build(args.out)
            rpc_server = gpu_rpc.find_rpc_server([gpu_check.CACHE])
    if rpc_server is None or not rpc_server.is_file():
        report.step("rpc", {"skipped": f"no rpc-server of a CUDA build with GGML_RPC found "
                                       f"({rpc_server or 'none in ' + str(cache)})"})
        return
    engine = cache / "llmgw" / "engines" / "llamacpp" / PINNED_VERSION / "llama-server"
    # The CUDA build's llama-server beside its rpc-server (rehearsed: the dry-run engine).
    gpu_main = rpc_server.parent / "llama-server"
    try:
        report.step("rpc", gpu_rpc.rpc_case(
            gpu_check, rpc_server=rpc_server, cpu_engine=engine, model=model,
            n_layer=int(shape["n_layer"]), out=args.out, work=work,
            gpu_memory=None if args.dry_run else gpu_memory_mib,
            main_engine=gpu_main if gpu_main.is_file() else None))
    except Exception as e:  # noqa: BLE001 - the line says what failed; the rest stands
        report.step("rpc", {"failed": f"{type(e).__name__}: {e}"[:800]})


def run(args: argparse.Namespace, report: Report, host: ThrowawayHost, model: Path,
        env: dict[str, str], gpu_check: ModuleType) -> int:
    started = time.monotonic()
    cuda = "off" if args.dry_run else "auto"
    provisioned = host.provision(f"--starter-source={model.as_uri()}", f"--engine-cuda={cuda}",
                                 "-rf", timeout=max(60.0, report.left_s(args.budget_s)),
                                 env=env)
    (args.out / "provision.log").write_text(provisioned.output)
    report.step("provision", {"rc": provisioned.returncode,
                              "s": round(time.monotonic() - started, 1),
                              "failed": provisioned.failed()[:3],
                              "warnings": provisioned.lines("warn")[:3]})
    if provisioned.returncode != 0:
        return 1
    if args.dry_run:
        gpu_engine = standin_gpu_engine(host.state_dir.parent / "cuda", args.dry_run)
        agent_yaml = host.state_dir / "etc" / "agent.yaml"
        config = yaml.safe_load(agent_yaml.read_text())
        config.setdefault("engine", {}).update(cuda="auto", cuda_server=str(gpu_engine))
        agent_yaml.write_text(yaml.safe_dump(config))
        Supervisor(host.state_dir).restart("llmgw-agent")

    built_from = time.monotonic()
    build: dict[str, Any] = {}
    while report.left_s(args.budget_s) > 120:
        build = engine_states(host).get(CUDA_ENGINE, {})
        if build.get("state") in START_AT:
            break
        time.sleep(0.5)
    report.step("gpu_engine_near", {**build, "s": round(time.monotonic() - built_from, 1)})
    if build.get("state") == "failed" or report.left_s(args.budget_s) <= 120:
        return 1

    model_name = live_replicas(host)[0]["model"]
    moved = report.step("move", move_under_load(host, model_name,
                                                min(240.0, report.left_s(args.budget_s) - 60)))
    report.step("gpu_engine", {**engine_states(host).get(CUDA_ENGINE, {}),
                               "ready_after_s": round(time.monotonic() - built_from, 1)})
    if not moved["moved"]:
        return 1

    replica = ready_replica(host)
    direct = Side("direct", replica["endpoint"], replica["api_key"])
    gateway = Side("gateway", f"http://127.0.0.1:{host.ports['gateway']}", host.gateway_key)
    payload = body(replica["model"])
    for width in (1, args.streams):
        if report.left_s(args.budget_s) < 4 * args.rounds * args.seconds + 30:
            break
        report.step(f"gateway_vs_direct_{width}",
                    rounds([direct, gateway], payload, width, args.seconds, args.rounds))

    pid, argv = engine_argv(int(replica["endpoint"].rsplit(":", 1)[1]))
    sized = {**props(direct), "parallel_flag": flag(argv, "--parallel", "-np"),
             "ctx_flag": flag(argv, "--ctx-size", "-c"),
             "gpu_layers_flag": flag(argv, "--n-gpu-layers", "-ngl"),
             "device_flag": flag(argv, "--device", "-dev"), "argv": redacted(argv[1:])}
    report.step("sized", sized)
    if report.left_s(args.budget_s) < 2 * args.rounds * args.seconds + 60:
        return 0
    port = free_port()
    log = args.out / "default-slots.log"
    proc = start_default(argv, port, log)
    try:
        default = Side("default", f"http://127.0.0.1:{port}", direct.key)
        wait_health(default.url, proc, log, 120)
        report.step("default", {**props(default), **gpu_check.offload(log.read_text()),
                                "gpu_memory_mib": gpu_memory_mib([pid, proc.pid])})
        sized_side = Side("sized", direct.url, direct.key)
        report.step("sized_vs_default", rounds([default, sized_side], payload, args.streams,
                                               args.seconds, args.rounds))
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
    if len(report.data.get("nvml", {}).get("gpus", [])) >= 2 \
            and report.left_s(args.budget_s) > 90:
        report.step("split", split_over_two(host, bool(args.dry_run),
                                            min(120.0, report.left_s(args.budget_s) - 40),
                                            args.seconds))
    return 0


def finish(report: Report, rc: int) -> int:
    """The one JSON line: what each goal asked, and what was seen."""
    d = report.data
    move, one = d.get("move", {}), d.get("gateway_vs_direct_1", {})
    wide = next((v for k, v in d.items() if k.startswith("gateway_vs_direct_")
                 and k != "gateway_vs_direct_1"), {})
    slots = d.get("sized_vs_default", {})
    rpc = d.get("rpc", {})
    gpus = d.get("nvml", {}).get("gpus", [])
    line = {
        "gpu": gpus[0]["name"] if gpus else None, "driver": d.get("nvml", {}).get("driver"),
        "provision_s": d.get("provision", {}).get("s"),
        "gpu_engine": d.get("gpu_engine", d.get("gpu_engine_near", {})).get("state"),
        "gpu_engine_ready_s": d.get("gpu_engine", {}).get("ready_after_s"),
        "move_failed": move.get("failed"), "move_requests": move.get("requests"),
        "moved": move.get("moved"),
        "gateway_direct_1": one.get("ratio"), "gateway_direct_32": wide.get("ratio"),
        "gateway_tokens_per_s_32": wide.get("gateway_tokens_per_s"),
        "sized_slots": d.get("sized", {}).get("total_slots"),
        "default_slots": d.get("default", {}).get("total_slots"),
        "sized_default_32": slots.get("ratio"),
        "sized_tokens_per_s_32": slots.get("sized_tokens_per_s"),
        "layers_offloaded": d.get("default", {}).get("layers_offloaded"),
        "moved_under_load": move.get("under_load"),
        "split_gpus": d.get("split", {}).get("gpus"),
        "split_tokens_per_s_1": d.get("split", {}).get("tokens_per_s_1"),
        "rpc_answer_equal": rpc.get("answer_equal"),
        "rpc_same_tokens": rpc.get("tokens", {}).get("same_tokens"),
        "rpc_max_logprob_diff": rpc.get("tokens", {}).get("max_logprob_diff"),
        "rpc_gap_at_parting": rpc.get("tokens", {}).get("gap_at_parting"),
        "rpc_layers_offloaded": rpc.get("layers_offloaded"),
        "rpc_buffers_mib": rpc.get("rpc_buffers_mib"),
        "rpc_server_devices": rpc.get("rpc_server_devices"),
        "rpc_server_gpu_mib": rpc.get("rpc_server_gpu_mib"),
        "rpc_split_tokens_per_s": rpc.get("split_tokens_per_s"),
        "rpc_unsplit_tokens_per_s": rpc.get("unsplit_tokens_per_s"),
        "rpc_split_unsplit": rpc.get("split_unsplit"),
        "rpc_failed": rpc.get("failed") or rpc.get("skipped"),
        "rpc_gpu_main_answer_equal": (rpc.get("gpu_main") or {}).get("answer_equal"),
        "rpc_gpu_main_layers_offloaded": (rpc.get("gpu_main") or {}).get("layers_offloaded"),
        "rpc_gpu_main_buffers_mib": (rpc.get("gpu_main") or {}).get("buffers_mib"),
        "rpc_gpu_main_tokens_per_s": (rpc.get("gpu_main") or {}).get("tokens_per_s"),
        "rpc_gpu_main_failed": (rpc.get("gpu_main") or {}).get("failed"),
        "goals": {"no_failed_request": move.get("failed") == 0 and bool(move.get("moved"))
                  and bool(move.get("under_load")),
                  "gateway_ge_0.95": all(r is not None and r >= 0.95
                                         for r in (one.get("ratio"), wide.get("ratio"))),
                  "sized_ge_3x": (slots.get("ratio") or 0) >= 3,
                  **({"split_on_2_gpus": bool(d["split"].get("ok"))} if "split" in d else {}),
                  **({"rpc_matches_unsplit": bool(rpc.get("tokens", {}).get("matches"))}
                     if rpc else {}),
                  **({"rpc_worker_on_gpu": rpc["held_on_gpu"]}
                     if rpc.get("held_on_gpu") is not None else {})},
        "elapsed_s": d.get("elapsed_s"), "rc": rc,
    }
    (report.out / "gpu-check.json").write_text(json.dumps(line) + "\n")
    print(json.dumps(line), flush=True)
    return rc


def copy_logs(host: ThrowawayHost, cache: Path, out: Path) -> None:
    """The agent's log and the CUDA build's, whatever happened (their ends only)."""
    for source, name in ((host.state_dir / "logs" / "llmgw-agent.log", "agent.log"),
                         (next(iter(sorted(cache.glob("llmgw/engines/llamacpp/*-cuda*/build.log"))),
                               None), "cuda-build.log")):
        if source is not None and source.is_file():
            text = source.read_text(errors="replace")
            (out / name).write_text(text[-400_000:])


if __name__ == "__main__":
    sys.exit(main())
