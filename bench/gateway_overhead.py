"""What the gateway adds to a chat completion, measured side by side in one run.

Run on demand, not in the suite:  python bench/gateway_overhead.py [--requests 200]

Serves the tests' tiny GGUF with the real llama-server (a few ms per 8-token answer, so
the gateway's own cost is visible), then sends the same requests straight to the engine
and through the gateway (the real FastAPI app on uvicorn, the replica's key added by the
gateway), sequentially and 8 at a time, and prints latencies and the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llmgw.agent.engine import LlamaCpp  # noqa: E402
from llmgw.config import EngineConfig  # noqa: E402
from llmgw.control.gateway import make_gateway_app, upstream_client  # noqa: E402
from llmgw.control.store import Store  # noqa: E402
from llmgw.netaddr import free_port  # noqa: E402
from tests.tiny_gguf import write_tiny_gguf  # noqa: E402

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
        "temperature": 0}


def engine_binary() -> str:
    engine = LlamaCpp(EngineConfig())
    status = engine.provision()
    if status.state != "ready" or engine.found is None:
        sys.exit(f"no llama-server: {status.detail}")
    return str(engine.found.path)


def wait_ok(url: str, headers: dict[str, str] | None = None) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, headers=headers, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    sys.exit(f"{url} did not answer within 60s")


def sequential(url: str, headers: dict[str, str], n: int) -> list[float]:
    times = []
    with httpx.Client(timeout=30) as client:
        for _ in range(n):
            start = time.perf_counter()
            r = client.post(url, json=BODY, headers=headers)
            times.append(time.perf_counter() - start)
            r.raise_for_status()
    return times


async def concurrent(url: str, headers: dict[str, str], n: int, width: int) -> float:
    """Requests per second with width requests in flight."""
    async with httpx.AsyncClient(timeout=60) as client:
        left = iter(range(n))

        async def worker() -> None:
            for _ in left:
                (await client.post(url, json=BODY, headers=headers)).raise_for_status()

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(width)))
        return n / (time.perf_counter() - start)


def ms(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] * 1000 if q < 100 else max(values)


def serve_gateway(work: Path, port: int) -> None:
    """The real gateway app on uvicorn, over the bench's store."""
    app = make_gateway_app(Store(work / "control.db"), tokens=[], upstream=upstream_client())
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def main() -> None:
    if sys.argv[1:2] == ["--serve-gateway"]:
        serve_gateway(Path(sys.argv[2]), int(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--width", type=int, default=8)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="llmgw-bench-"))
    gguf = work / "tiny.gguf"
    write_tiny_gguf(gguf)
    key, engine_port, gw_port = secrets.token_urlsafe(16), free_port(), free_port()
    engine = subprocess.Popen(
        [engine_binary(), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(engine_port),
         "--api-key", key, "--ctx-size", "2048", "--parallel", str(args.width)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    store = Store(work / "control.db")
    store.add_model({"name": "tiny", "aliases": [], "source": gguf.as_uri(), "sha256": "",
                     "profiles": []})
    store.put_replica({"id": "r1", "model": "tiny", "node": "bench", "profile": "cpu",
                       "state": "ready", "endpoint": f"http://127.0.0.1:{engine_port}",
                       "api_key": key})
    store.close()
    # Its own process, as in production: it must not share a GIL with the load generator.
    gateway = subprocess.Popen([sys.executable, __file__, "--serve-gateway", str(work),
                                str(gw_port)])
    try:
        direct = f"http://127.0.0.1:{engine_port}/v1/chat/completions"
        via = f"http://127.0.0.1:{gw_port}/v1/chat/completions"
        auth = {"Authorization": f"Bearer {key}"}
        wait_ok(f"http://127.0.0.1:{engine_port}/health")
        wait_ok(f"http://127.0.0.1:{gw_port}/healthz")
        sequential(direct, auth, 10), sequential(via, {}, 10)  # warm both
        d, g = sequential(direct, auth, args.requests), sequential(via, {}, args.requests)
        d_rps = asyncio.run(concurrent(direct, auth, args.requests, args.width))
        g_rps = asyncio.run(concurrent(via, {}, args.requests, args.width))
    finally:
        for proc in (gateway, engine):
            proc.terminate()
            proc.wait(10)
    print(f"{args.requests} chat completions of 8 tokens, tiny GGUF, sequential then "
          f"{args.width} in flight")
    print(f"{'':<10}{'p50 ms':>10}{'p95 ms':>10}{'req/s (' + str(args.width) + ')':>14}")
    print(f"{'direct':<10}{ms(d, 50):>10.2f}{ms(d, 95):>10.2f}{d_rps:>14.1f}")
    print(f"{'gateway':<10}{ms(g, 50):>10.2f}{ms(g, 95):>10.2f}{g_rps:>14.1f}")
    print(f"gateway/direct: p50 x{ms(g, 50) / ms(d, 50):.2f}, p95 x{ms(g, 95) / ms(d, 95):.2f}, "
          f"throughput x{g_rps / d_rps:.2f}; added p50 {ms(g, 50) - ms(d, 50):.2f} ms")


if __name__ == "__main__":
    main()
