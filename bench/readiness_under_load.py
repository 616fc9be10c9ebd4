"""A replica under load stays ready, and every request through the gateway gets a 200.

Run on demand:  python bench/readiness_under_load.py [--seconds 30] [--clients 32]
                                                     [--direct] [--engine-args ARGS]

The agent's replica supervisor starts the real llama-server on the tests' tiny GGUF; the
real gateway runs on its own server (llmgw.http1.server) in its own process; `hey` (or a Python
generator in its own process) sends --clients concurrent chat completions through the
gateway for --seconds. Meanwhile this process plays the agent's heartbeat: every second it asks the
supervisor for its report (which probes /health) and separately times a bare /health
probe, the way the agent probed before issue 11 (2 s timeout, one failure = not ready).
It prints the status codes, the states the replica was reported in, the probe latencies
and how many of the old probes would have failed, and the state changes the agent counted.

The engine starts with the arguments the control plane gives it (model/engine_args.py),
--engine-args added to its profile. --direct sends the load to the engine itself, as a
client holding --clients keep-alive connections: with '--engine-args "--threads-http 6"'
(llama-server's own default for 4 slots) that shows probes waiting seconds for an HTTP
thread, which the control plane's --threads-http prevents.
"""

from __future__ import annotations

import argparse
import functools
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._engine import llama_server, wait_ok  # noqa: E402
from bench.gateway_overhead import Side, hey, python_load, request_body  # noqa: E402
from llmgw.agent.replicas.process import stop_engines  # noqa: E402
from llmgw.agent.replicas.supervisor import ReplicaSupervisor  # noqa: E402
from llmgw.host.netaddr import free_port  # noqa: E402
from llmgw.model.engine_args import engine_args  # noqa: E402
from llmgw.store import Store  # noqa: E402
from tests.tiny_gguf import write_tiny_gguf  # noqa: E402

OLD_PROBE_TIMEOUT_S = 2.0


def heartbeat(sup: ReplicaSupervisor, stop: threading.Event, states: list[str],
              reports: list[float], probes: list[float | None]) -> None:
    """Every second: the agent's report (its own probe included), timed, then a bare probe
    on a fresh connection, as the agent's probe is made."""
    while not stop.wait(1.0):
        start = time.perf_counter()
        report = sup.report()[0]
        reports.append(time.perf_counter() - start)
        states.append(report["state"])
        start = time.perf_counter()
        try:
            httpx.get(f"{report['endpoint']}/health", timeout=10.0)
            probes.append(time.perf_counter() - start)
        except httpx.HTTPError:
            probes.append(None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--parallel", type=int, default=4,
                        help="llama-server slots (its default is 4)")
    parser.add_argument("--direct", action="store_true",
                        help="load the engine itself, not through the gateway")
    parser.add_argument("--engine-args", default="",
                        help="more llama-server flags for the replica's profile, one string")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="llmgw-load-"))
    gguf = work / "tiny.gguf"
    write_tiny_gguf(gguf)
    # The agent fetches weights over http(s) only: the file is served on loopback.
    files = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(
        SimpleHTTPRequestHandler, directory=str(work)))
    threading.Thread(target=files.serve_forever, daemon=True).start()
    source = f"http://127.0.0.1:{files.server_port}/tiny.gguf"
    engine = llama_server()
    sup = ReplicaSupervisor(state_dir=work / "agent", weights_dir=work / "weights",
                            engine=lambda: engine, bind_host="127.0.0.1")
    profile = {"args": ["--ctx-size", "2048", "--parallel", str(args.parallel),
                        *shlex.split(args.engine_args)]}
    sup.reconcile([{"id": "r1", "model": "tiny", "profile": "cpu", "source": source,
                    "args": engine_args({"name": "tiny"}, profile)}])
    deadline = time.monotonic() + 60
    while sup.report()[0]["state"] != "ready":
        assert time.monotonic() < deadline, f"not ready: {sup.report()}"
        time.sleep(0.2)
    report = sup.report()[0]
    store = Store(work / "control.db")
    store.add_model({"name": "tiny", "aliases": [], "source": gguf.as_uri(), "profiles": []})
    store.put_replica({"id": "r1", "model": "tiny", "node": "bench", "profile": "cpu",
                       "state": "ready", "endpoint": report["endpoint"],
                       "api_key": report["api_key"]})
    store.close()
    gw_port = free_port()
    gateway = subprocess.Popen([sys.executable, str(Path(__file__).parent /
                                                    "gateway_overhead.py"),
                                "--serve-gateway", str(work), str(gw_port)])
    stop, states, reports, probes = threading.Event(), [], [], []
    try:
        wait_ok(f"http://127.0.0.1:{gw_port}/healthz")
        beat = threading.Thread(target=heartbeat, args=(sup, stop, states, reports, probes))
        beat.start()
        load = hey if shutil.which("hey") else python_load
        target = (Side(f"{report['endpoint']}/v1/chat/completions", report["api_key"], 0)
                  if args.direct else
                  Side(f"http://127.0.0.1:{gw_port}/v1/chat/completions", "", 0))
        run = load(target, request_body("tiny"), args.clients, args.seconds)
        stop.set()
        beat.join()
    finally:
        gateway.terminate()
        gateway.wait(10)
        stop_engines(work / "agent")
    timed = [p for p in probes if p is not None]
    old_failures = sum(p is None or p > OLD_PROBE_TIMEOUT_S for p in probes)
    print(f"load: {'hey' if load is hey else 'Python generator'}, {args.clients} clients "
          f"{'straight to the engine' if args.direct else 'through the gateway'}, "
          f"{args.seconds:.0f} s, 8-token answers, engine args "
          f"{' '.join(engine_args({'name': 'tiny'}, profile))}")
    print(f"throughput {run.rps:.1f} req/s, p50 {run.p50_ms:.1f} ms, non-200: {run.non_200}")
    print(f"states reported each second: {dict((s, states.count(s)) for s in set(states))}"
          f"; a report (the agent's probe in it) took p50 {statistics.median(reports):.2f} s, "
          f"max {max(reports):.2f} s")
    if timed:
        print(f"/health probe: {len(probes)} probes, p50 {statistics.median(timed)*1000:.0f} ms,"
              f" max {max(timed)*1000:.0f} ms; over {OLD_PROBE_TIMEOUT_S:.0f} s or failed "
              f"(the old probe's 'not ready'): {old_failures}")
    print("agent's state changes:", json.dumps(sup.facts()["replica_state_changes"]))
    left_ready = [s for s in states if s != "ready"]
    print(f"result: {'only 200s' if run.non_200 == 0 else f'{run.non_200} non-200'}; replica "
          f"{'never left ready' if not left_ready else f'left ready {len(left_ready)} times'}")


if __name__ == "__main__":
    main()
