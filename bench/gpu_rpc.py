"""The RPC case of `scripts/gpu-check --fleet` (bench/gpu_fleet.py's last step, or alone with
`--rpc-only`): one model split between a CPU main engine and a GPU rpc-server, through the
agents' TLS relay, against the same model unsplit.

    CPU llama-server --rpc 127.0.0.1:P -ngl K  ->  MainRelay  ==TLS 1.3==>  WorkerRelay
    (the CPU build --prepare carried)              (main-1)                  (worker-1, on
                                                                              127.0.0.2)
                                                                          -> rpc-server
                                                                             (the CUDA build's,
                                                                              127.0.0.1:R)

The certificates (a cluster CA, main-1's and worker-1's) and an empty revocation list are
made at run time; the worker's relay checks that list in its handshake, as an agent's does.
The model's last half of its layers go to the rpc-server (its output layer stays on the
main engine, as rpc_argv.main_flags keeps it). One
question at temperature 0 to each engine in turn: the unsplit one (the CPU engine alone),
then the split one. What is recorded: whether the answers are the same text (and the first
character where they part), the layers the main engine offloaded and each buffer's MiB by
device (its loader's lines: the `RPC0[...]` ones are what the rpc-server holds, which its
own log does not print), the devices the rpc-server's log says it serves, the GPU memory
NVML says the rpc-server process holds while the split engine is up (None without NVML's
process list, as on the stand-in), the relays' connections and bytes, and tokens/s split
against unsplit.

With main_engine (the CUDA build's llama-server beside its rpc-server), the same split once
more with that engine as the main, on this machine's card, as an agent runs the main of a
GPU profile split over nodes (rpc_argv.gpu_main_flags: every layer offloaded, the RPC
device first, then CUDA0, whose share keeps the output layer): its answer against the
unsplit one's, its offload and buffers by device (`CUDA0` the main's share, `RPC0[...]`
the worker's; the output off the CPU), tokens/s.
"""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from cryptography.hazmat.primitives import serialization

from llmgw.agent import rpc_relay
from llmgw.agent.replicas import rpc_argv
from llmgw.agent.revocation import Revocations
from llmgw.agent.rpc_relay import MainRelay, Worker, WorkerRelay
from llmgw.config import TLSFiles
from llmgw.host import pki
from llmgw.host.netaddr import free_port

# The worker's management address: a second loopback address, so the relay's leg between
# the nodes is a listener of its own, as on two machines.
WORKER_ADDR = "127.0.0.2"
MAIN, WORKER = "main-1", "worker-1"
LISTEN_WAIT_S = 30.0
# Log-probabilities of the same token, split and unsplit, may differ by the rounding of
# another device's sums (and another order of them); a tie nearer than TIE_NATS may then
# go either way.
LOGPROB_TOLERANCE = 0.01
TIE_NATS = 0.01


def certificates(directory: Path) -> tuple[dict[str, TLSFiles], pki.KeyPair]:
    """A cluster CA made now, main-1's and worker-1's client certificates (as the control
    plane signs nodes'), written to directory; their TLS files by node, and the CA."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = pki.create_ca("llmgw gpu-check CA")
    ca_file = directory / "ca.pem"
    ca_file.write_bytes(ca.cert.public_bytes(serialization.Encoding.PEM))
    files = {}
    for node in (MAIN, WORKER):
        cert, key = pki.issue_client(ca, node).write(directory, node)
        files[node] = TLSFiles(ca=str(ca_file), cert=str(cert), key=str(key))
    return files, ca


def rpc_devices(log_text: str) -> list[str]:
    """The devices rpc-server's log says it serves (`Devices:` then `  CUDA0: NVIDIA H200
    (143771 MiB, 143000 MiB free)`), each line stripped."""
    lines = log_text.splitlines()
    if "Devices:" not in [line.strip() for line in lines]:
        return []
    start = [line.strip() for line in lines].index("Devices:") + 1
    found = []
    for line in lines[start:]:
        if not line.startswith("  ") or ":" not in line or line.strip().startswith(
                ("transport", "endpoint", "local cache")):
            break
        found.append(line.strip())
    return found


def start_rpc_server(binary: Path, out: Path) -> tuple[subprocess.Popen[bytes], int, Path]:
    """rpc-server on a free 127.0.0.1 port (the command line an agent gives it), logging to
    out/rpc-server.log; once it listens."""
    port = free_port(rpc_relay.LOOPBACK)
    log = out / "rpc-server.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(rpc_argv.rpc_server_command(str(binary), port, []),
                                stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + LISTEN_WAIT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"rpc-server {binary} exited {proc.returncode} before it "
                               f"listened: {' | '.join(log.read_text().splitlines()[-5:])}")
        if "endpoint" in log.read_text(errors="replace") and _listens(port):
            return proc, port, log
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"rpc-server did not listen on 127.0.0.1:{port} within "
                               f"{LISTEN_WAIT_S:.0f}s; its log: {log.read_text()[-500:]}")
        time.sleep(0.2)


def _listens(port: int) -> bool:
    want = f"0100007F:{port:04X}"
    try:
        rows = Path("/proc/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return False
    return any(r.split()[1] == want and r.split()[3] == "0A" for r in rows)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _gap(item: dict[str, Any]) -> float | None:
    """How far the chosen token's log-probability is above the runner-up's (nats)."""
    top = sorted((float(t["logprob"]) for t in item.get("top_logprobs", [])), reverse=True)
    return round(top[0] - top[1], 6) if len(top) >= 2 else None


def compare(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> dict[str, Any]:
    """Two answers token by token (llama.cpp's completion_probabilities, n_probs 2): how
    many tokens they share from the start, the largest log-probability difference over
    those, and where they part, how near a tie the unsplit answer (a) was there: random
    weights give near-uniform logits, where another device's rounding may choose the
    runner-up. matches: the same tokens throughout, or parted only at a near tie (gap at
    most TIE_NATS) with log-probabilities within LOGPROB_TOLERANCE before it."""
    same, worst = 0, 0.0
    for x, y in zip(a, b, strict=False):
        if x.get("id", x.get("token")) != y.get("id", y.get("token")):
            break
        worst = max(worst, abs(float(x["logprob"]) - float(y["logprob"])))
        same += 1
    found: dict[str, Any] = {"tokens": len(a), "same_tokens": same,
                             "max_logprob_diff": round(worst, 6)}
    whole = same == len(a) == len(b) and bool(a)
    if not whole and same < min(len(a), len(b)):
        found["gap_at_parting"] = gap = _gap(a[same])
        found["parted_at_near_tie"] = gap is not None and gap <= TIE_NATS
    found["matches"] = whole or (bool(found.get("parted_at_near_tie"))
                                 and worst <= LOGPROB_TOLERANCE)
    return found


def parted_at(a: str, b: str) -> int | None:
    """The first character where a and b differ (None where they are the same text)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


def rpc_case(gpu_check: ModuleType, *, rpc_server: Path, cpu_engine: Path, model: Path,
             n_layer: int, out: Path, work: Path,
             gpu_memory: Callable[[list[int]], dict[str, int] | None] | None = None,
             main_engine: Path | None = None) -> dict[str, Any]:
    """The case run once: unsplit, then split through the relays (and with main_engine, split
    with a GPU main); what it found (see the module's docstring). gpu_memory(pids) is NVML's
    memory by pid (bench/gpu_fleet.py's)."""
    started = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    unsplit = gpu_check.serve_once(str(cpu_engine), model, out, "rpc-unsplit", [], n_probs=2)
    files, ca = certificates(work / "pki")
    revocations = Revocations(files[WORKER].ca)
    # The empty list of this CA, so the worker's handshake checks revocation as an agent's.
    revocations.update(pki.make_crl(ca, [], last_update=dt.datetime.now(dt.UTC)
                                    - dt.timedelta(minutes=5)))
    proc, port, log = start_rpc_server(rpc_server, out)
    worker = WorkerRelay(files[WORKER], host=WORKER_ADDR, upstream_port=port, main_node=MAIN,
                         revocations=revocations)
    main = MainRelay(files[MAIN], [Worker(WORKER, WORKER_ADDR, worker.start())])
    try:
        main.start()
        layers = n_layer // 2  # the last half of the blocks (main_flags keeps the output)

        def held() -> dict[str, Any]:
            memory = gpu_memory([proc.pid]) if gpu_memory is not None else None
            return {"rpc_server_gpu_mib": None if memory is None else memory.get(str(proc.pid))}

        split = gpu_check.serve_once(str(cpu_engine), model, out, "rpc-split",
                                     rpc_argv.main_flags(main.endpoints(), layers), held,
                                     n_probs=2)
        alive = proc.poll() is None
        gpu_main = None if main_engine is None else _gpu_main(
            gpu_check, main_engine, model, out, main.endpoints(), [layers, n_layer - layers],
            unsplit)
    finally:
        main.stop()
        worker.stop()
        _stop(proc)
        revocations.stop()
    text = log.read_text(errors="replace")
    a, b = unsplit.get("content") or "", split.get("content") or ""
    rpc_buffers = {kind: {dev: mib for dev, mib in by_device.items() if dev.startswith("RPC")}
                   for kind, by_device in split.get("buffers_mib", {}).items()}
    devices = rpc_devices(text)
    held_mib = split.get("rpc_server_gpu_mib")
    return {
        # On a GPU: the rpc-server serves a CUDA device, the engine gave it a model buffer,
        # and NVML has its process holding memory (None where NVML cannot say: rehearsed).
        "held_on_gpu": None if gpu_memory is None else bool(
            any(d.startswith("CUDA") for d in devices) and rpc_buffers.get("model")
            and (held_mib or 0) > 0),
        "answer_equal": a == b and bool(a), "parted_at": parted_at(a, b),
        "answer_chars": len(a),
        "tokens": compare(unsplit.get("probs", []), split.get("probs", [])),
        "layers_to_rpc_flag": layers, "layers_offloaded": split.get("layers_offloaded"),
        "rpc_buffers_mib": {k: v for k, v in rpc_buffers.items() if v},
        "buffers_mib": split.get("buffers_mib"),
        "rpc_server_devices": devices,
        "rpc_server_connections": text.count("Accepted client connection"),
        "rpc_server_alive_after": alive,
        "rpc_server_gpu_mib": held_mib,
        "relay": {"carried": main.counters.carried, "refused": main.counters.refused
                  + worker.counters.refused, "bytes_to_worker": worker.counters.bytes_in,
                  "bytes_from_worker": worker.counters.bytes_out,
                  "main_cpu_s": round(main.cpu_seconds(), 2),
                  "worker_cpu_s": round(worker.cpu_seconds(), 2)},
        "unsplit_tokens_per_s": unsplit.get("tokens_per_s"),
        "split_tokens_per_s": split.get("tokens_per_s"),
        "split_unsplit": round(split["tokens_per_s"] / unsplit["tokens_per_s"], 3)
        if unsplit.get("tokens_per_s") and split.get("tokens_per_s") else None,
        "gpu_main": gpu_main,
        "rpc_server": str(rpc_server), "main_engine": str(cpu_engine),
        "s": round(time.monotonic() - started, 1),
    }


def _gpu_main(gpu_check: ModuleType, engine: Path, model: Path, out: Path, endpoints: str,
              split: list[int], unsplit: dict[str, Any]) -> dict[str, Any]:
    """The split served once more with engine as a GPU main (rpc_argv.gpu_main_flags, the
    worker's layers then its own); what it found, or why it failed (the rest stands)."""
    flags = rpc_argv.gpu_main_flags(endpoints, split)
    try:
        served = gpu_check.serve_once(str(engine), model, out, "rpc-split-gpu-main", flags,
                                      n_probs=2)
    except Exception as e:  # noqa: BLE001 - said in the result; the CPU main's case stands
        return {"failed": f"{type(e).__name__}: {e}"[:800], "flags": flags}
    a, b = unsplit.get("content") or "", served.get("content") or ""
    return {"answer_equal": a == b and bool(a), "parted_at": parted_at(a, b),
            "tokens": compare(unsplit.get("probs", []), served.get("probs", [])),
            "layers_offloaded": served.get("layers_offloaded"),
            "buffers_mib": served.get("buffers_mib"),
            "tokens_per_s": served.get("tokens_per_s"), "flags": flags,
            "engine": str(engine)}


def find_rpc_server(roots: list[Path]) -> Path | None:
    """The newest rpc-server of a CUDA build (<version>-cuda<major>-sm<archs>-rpc/) in the
    engine caches under roots (each an XDG cache's llmgw folder)."""
    found = [p for root in roots
             for p in root.glob("engines/llamacpp/*-cuda*-rpc/rpc-server")
             if p.is_file() and os.access(p, os.X_OK)]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None
