"""What the gateway costs a chat completion, direct and through it side by side in one run.

Run on demand, not in the suite:  python bench/gateway_overhead.py [--seconds 4] [--pairs 5]

Serves the tests' tiny GGUF with the real llama-server (a few ms per 8-token answer, so
the gateway's own cost is visible) and the real gateway app under uvicorn in its own
process, then loads both at 1 and at 16 requests in flight in --pairs short pairs
(direct, then gateway, back to back) and reports the median of the pairs' ratios: on a
shared, noisy machine the load drifts from second to second, and a pair measured back to
back sees nearly the same drift on both sides. The load comes from `hey`
where it is installed (apt install hey), else from a Python generator in its own process;
the first line printed says which. The last line is:

    gateway/direct: throughput 0.NN× at 16, 0.NN× at 1; p50 +N.N ms at 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llmgw.agent.engine import LlamaCpp  # noqa: E402
from llmgw.config import EngineConfig  # noqa: E402
from llmgw.control._upstream import Upstream  # noqa: E402
from llmgw.control.gateway import make_gateway_app  # noqa: E402
from llmgw.control.metrics import GatewayMetrics  # noqa: E402
from llmgw.control.store import Store  # noqa: E402
from llmgw.netaddr import free_port  # noqa: E402
from tests.tiny_gguf import write_tiny_gguf  # noqa: E402

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
        "temperature": 0}
WIDTHS = (1, 16)


@dataclass
class Run:
    rps: float
    p50_ms: float
    non_200: int
    count: int = 0
    # CPU seconds per request, by process (engine, gateway): robust where wall time is not.
    cpu_ms: dict[str, float] | None = None


def cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def engine_binary() -> str:
    engine = LlamaCpp(EngineConfig())
    status = engine.provision()
    if status.state != "ready" or engine.found is None:
        sys.exit(f"no llama-server: {status.detail}")
    return str(engine.found.path)


def wait_ok(url: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    sys.exit(f"{url} did not answer within 60s")


def hey(url: str, key: str, width: int, seconds: float) -> Run:
    out = subprocess.run(
        ["hey", "-z", f"{seconds}s", "-c", str(width), "-m", "POST", "-T", "application/json",
         "-H", f"Authorization: Bearer {key}", "-d", json.dumps(BODY), url],
        capture_output=True, text=True, check=True).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out)[1])
    p50 = float(re.search(r"50%+ in ([\d.]+) secs", out)[1]) * 1000
    codes = {int(c): int(n) for c, n in re.findall(r"\[(\d+)\]\s+(\d+) responses", out)}
    return Run(rps, p50, sum(n for c, n in codes.items() if c != 200), sum(codes.values()))


async def _generate(url: str, key: str, width: int, seconds: float) -> Run:
    """The fallback generator: width keep-alive connections, each one request at a time."""
    upstream, body = Upstream(), json.dumps(BODY).encode()
    base, path = url.split("/v1/", 1)
    times: list[float] = []
    bad = 0
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal bad
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            response = await upstream.post(base, "/v1/" + path, body, key)
            await response.read()
            times.append(time.perf_counter() - start)
            bad += response.status != 200

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(width)))
    elapsed = time.perf_counter() - start
    await upstream.aclose()
    return Run(len(times) / elapsed, statistics.median(times) * 1000, bad, len(times))


def python_load(url: str, key: str, width: int, seconds: float) -> Run:
    """The fallback generator in its own process, so it shares no GIL with anything."""
    out = subprocess.run([sys.executable, __file__, "--generate", url, key, str(width),
                          str(seconds)], capture_output=True, text=True, check=True).stdout
    return Run(**json.loads(out))


def measured(load, url: str, key: str, width: int, seconds: float,  # type: ignore[no-untyped-def]
             pids: dict[str, int]) -> Run:
    before = {name: cpu_s(pid) for name, pid in pids.items()}
    run = load(url, key, width, seconds)
    run.cpu_ms = {name: (cpu_s(pid) - before[name]) * 1000 / max(run.count, 1)
                  for name, pid in pids.items()}
    return run


def serve_gateway(work: Path, port: int) -> None:
    """The real gateway app on uvicorn, over the bench's store, as `llmgw server` runs it."""
    from prometheus_client import CollectorRegistry

    app = make_gateway_app(Store(work / "control.db"), tokens=[], upstream=Upstream(),
                           metrics=GatewayMetrics(CollectorRegistry()))
    from llmgw._serving import quiet_server, run_service
    run_service(quiet_server(app, f"127.0.0.1:{port}").serve())


def start(work: Path, width: int, engine_args: list[str]
          ) -> tuple[subprocess.Popen[bytes], subprocess.Popen[bytes], str, str, str]:
    gguf = work / "tiny.gguf"
    write_tiny_gguf(gguf)
    key, engine_port, gw_port = secrets.token_urlsafe(16), free_port(), free_port()
    engine = subprocess.Popen(
        [engine_binary(), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(engine_port),
         "--api-key", key, "--metrics", "--ctx-size", "2048", "--parallel", str(width),
         *engine_args],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    store = Store(work / "control.db")
    store.add_model({"name": "tiny", "aliases": [], "source": gguf.as_uri(), "sha256": "",
                     "profiles": []})
    store.put_replica({"id": "r1", "model": "tiny", "node": "bench", "profile": "cpu",
                       "state": "ready", "endpoint": f"http://127.0.0.1:{engine_port}",
                       "api_key": key})
    store.close()
    gateway = subprocess.Popen([sys.executable, __file__, "--serve-gateway", str(work),
                                str(gw_port)])
    wait_ok(f"http://127.0.0.1:{engine_port}/health")
    wait_ok(f"http://127.0.0.1:{gw_port}/healthz")
    return (engine, gateway, key, f"http://127.0.0.1:{engine_port}/v1/chat/completions",
            f"http://127.0.0.1:{gw_port}/v1/chat/completions")


def main() -> None:
    if sys.argv[1:2] == ["--serve-gateway"]:
        serve_gateway(Path(sys.argv[2]), int(sys.argv[3]))
        return
    if sys.argv[1:2] == ["--generate"]:
        url, key, width, seconds = sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5])
        print(json.dumps(asyncio.run(_generate(url, key, width, seconds)).__dict__))
        return
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=4.0, help="per measurement")
    parser.add_argument("--pairs", type=int, default=5, help="direct/gateway pairs per width")
    parser.add_argument("--gateway-nice", type=int, default=0,
                        help="run the gateway at this nice value (negative: ahead of the "
                             "engine's threads when both want the CPU)")
    parser.add_argument("--engine-args", default="",
                        help="more llama-server flags, as one string: '--threads 1' leaves "
                             "the gateway and the load generator a core of 2; '--poll 0' "
                             "stops the engine's threads spinning while they wait for work")
    args = parser.parse_args()
    load = hey if shutil.which("hey") else python_load
    print(f"load generator: {'hey' if load is hey else 'Python, in its own process'}; "
          f"{args.pairs} pairs of {args.seconds:.0f} s per width, medians of the pairs")
    engine, gateway, key, direct, via = start(Path(tempfile.mkdtemp(prefix="llmgw-bench-")),
                                              max(WIDTHS), shlex.split(args.engine_args))
    if args.gateway_nice:
        os.setpriority(os.PRIO_PROCESS, gateway.pid, args.gateway_nice)
    results: dict[tuple[str, int], list[Run]] = {}
    try:
        for url in (direct, via):
            load(url, key, 4, 1.0)  # warm both
        for width in WIDTHS:
            for _ in range(args.pairs):
                for side, url in (("direct", direct), ("gateway", via)):
                    results.setdefault((side, width), []).append(
                        measured(load, url, key, width, args.seconds,
                                 {"engine": engine.pid, "gateway": gateway.pid}))
    finally:
        for proc in (gateway, engine):
            proc.terminate()
            proc.wait(10)
    report(results)


def report(results: dict[tuple[str, int], list[Run]]) -> None:
    print(f"{'':<10}{'width':>6}{'req/s':>10}{'p50 ms':>10}{'non-200':>9}   each pair (req/s)")
    for (side, width), runs in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"{side:<10}{width:>6}{statistics.median(r.rps for r in runs):>10.1f}"
              f"{statistics.median(r.p50_ms for r in runs):>10.2f}"
              f"{sum(r.non_200 for r in runs):>9}   {', '.join(f'{r.rps:.0f}' for r in runs)}")

    def ratio(width: int) -> float:
        pairs = zip(results[("gateway", width)], results[("direct", width)], strict=True)
        return statistics.median(g.rps / d.rps for g, d in pairs)

    for width in WIDTHS:
        engine = statistics.median(r.cpu_ms["engine"] for r in results[("direct", width)])
        via = results[("gateway", width)]
        own = statistics.median(r.cpu_ms["gateway"] for r in via)
        print(f"CPU per request at {width}: engine {engine:.2f} ms direct, "
              f"{statistics.median(r.cpu_ms['engine'] for r in via):.2f} ms through the "
              f"gateway; the gateway's own {own:.2f} ms")
    pairs = zip(results[("gateway", 1)], results[("direct", 1)], strict=True)
    added = statistics.median(g.p50_ms - d.p50_ms for g, d in pairs)
    t16, t1 = ratio(16), ratio(1)
    met = [t16 >= 0.9, t1 >= 0.8, added <= 1.0]
    print(f"goals (>=0.9x at 16, >=0.8x at 1, p50 +<=1 ms): "
          f"{'met' if all(met) else 'NOT met: ' + str(met)}")
    print(f"gateway/direct: throughput {t16:.2f}× at 16, {t1:.2f}× at 1; p50 {added:+.1f} ms "
          "at 1")


if __name__ == "__main__":
    main()
