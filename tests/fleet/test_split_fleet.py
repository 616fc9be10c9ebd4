"""One model split over two real nodes (real control plane, agents and gateway on loopback,
the source build's llama-server and rpc-server): placed by the scheduler because no single
node holds it, answering through the gateway as the unsplit model does, and failed fast and
placed again when its worker's rpc-server is killed with a stream in flight."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmgw.agent import host
from llmgw.control.client import AdminClient
from tests.fleet.cluster import Agent, ControlPlane

pytestmark = pytest.mark.slow

BEAT_S = 1.0
NODE_TIMEOUT_S = 4.0
# The issue's bound: the stream in flight ends, the replica leaves ready.
LOST_WITHIN_S = 10.0
ASK = {"model": "tiny", "messages": [{"role": "user", "content": "The quick brown fox"}],
       "max_tokens": 24, "temperature": 0, "seed": 1}


def until(what: str, probe: Callable[[], Any], timeout_s: float = 120.0,
          last: Callable[[], object] = lambda: "") -> Any:
    __tracebackhide__ = True
    deadline = time.monotonic() + timeout_s
    while True:
        found = probe()
        if found:
            return found
        if time.monotonic() > deadline:
            pytest.fail(f"waited {timeout_s:.0f}s for {what}; last state: {last()}")
        time.sleep(0.2)


@pytest.fixture
def fleet(tmp_path: Path, rpc_engine: tuple[str, str]) -> Iterator[dict[str, Any]]:
    """Function: a control plane and nodes n1, n2 whose engine is the cached source build
    with rpc-server beside its llama-server (found as a node finds it: no engine configured,
    which llmgw could not know the RPC backend of); all stopped afterwards."""
    cp = ControlPlane(tmp_path / "cp", node_timeout_s=NODE_TIMEOUT_S).start()
    admin = cp.admin_client()
    agents: dict[str, Agent] = {}
    try:
        for name in ("n1", "n2"):
            agents[name] = Agent(tmp_path / name, name, cp.agent_api,
                                 cp.issue(name, tmp_path / name / "pki"),
                                 heartbeat_s=BEAT_S).start()
        yield {"cp": cp, "admin": admin, "agents": agents}
    finally:
        for agent in agents.values():
            agent.stop()
            agent.stop_engines()
        admin.close()
        cp.stop()


def _live(admin: AdminClient) -> list[dict[str, Any]]:
    return [dict(r) for r in admin.replicas("tiny") if r["state"] != "stopped"]


def _split_ready(admin: AdminClient, not_id: str = "") -> dict[str, Any] | None:
    return next((r for r in _live(admin) if r["state"] == "ready" and r.get("workers")
                 and r["id"] != not_id), None)


def _unsplit_answer(llama_server: str, model: Path) -> str:
    """The tiny model on one engine, asked ASK."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([llama_server, "-m", str(model), "--host", "127.0.0.1", "--port",
                             str(port), "-c", "512", "-t", "1", "--device", "none"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def answer() -> str:
            try:
                r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=ASK,
                               timeout=30)
            except httpx.HTTPError:
                return ""
            return str(r.json()["choices"][0]["message"]["content"]) if r.is_success else ""
        return str(until("the unsplit engine to answer", answer, 60))
    finally:
        proc.kill()
        proc.wait(5)


def test_a_model_no_node_holds_is_split_answers_as_unsplit_and_fails_fast(
        fleet: dict[str, Any], served_gguf: tuple[str, str], tiny_gguf: tuple[Path, str],
        rpc_engine: tuple[str, str]) -> None:
    """A profile with nodes: 2 whose min_memory_gb is more than one node's memory and less
    than two nodes': the scheduler splits it over n1 and n2; through the gateway it answers
    at temperature 0 with the unsplit model's text. The worker's rpc-server killed at the
    first token of a stream through the gateway: the stream ends with an error within
    LOST_WITHIN_S, the replica leaves ready within LOST_WITHIN_S, and a new split replica
    (a new id) is placed and serves. The control: the same stream before the kill runs to
    its end, and the replica stays ready."""
    admin, cp, agents = fleet["admin"], fleet["cp"], fleet["agents"]
    until("both nodes ready with rpc", lambda: sorted(
        n["id"] for n in admin.nodes() if n["state"] == "ready" and n.get("rpc")) == ["n1", "n2"],
        300, last=admin.nodes)
    node_gb = host.memory_mb() / 1024
    source, digest = served_gguf
    admin.add_model({"name": "tiny", "source": source, "sha256": digest,
                     "scaling": {"min": 1, "max": 1},
                     "profiles": [{"name": "cpu", "engine": "llamacpp", "nodes": 2,
                                   "min_memory_gb": round(node_gb * 1.5, 1),
                                   "args": ["--ctx-size", "2048", "--threads", "1"]}]})
    replica = until("a ready split replica", lambda: _split_ready(admin), 120,
                    last=lambda: admin.replicas("tiny"))
    worker = replica["workers"][0]["node"]
    assert {replica["node"], worker} == {"n1", "n2"}

    with httpx.Client(base_url=cp.gateway, timeout=60) as gw:
        r = gw.post("/v1/chat/completions", json=ASK)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == _unsplit_answer(
            rpc_engine[0], tiny_gguf[0])

        body = {**ASK, "max_tokens": 1500, "ignore_eos": True, "stream": True}
        rpc_pid = int(json.loads((agents[worker].root / "state" / "replicas"
                                  / f"{replica['id']}.json").read_text())["pid"])

        def stream(kill: bool) -> tuple[float, int, str]:
            killed_at, tokens, ended = time.monotonic(), 0, "cut"
            try:
                with gw.stream("POST", "/v1/chat/completions", json=body,
                               timeout=httpx.Timeout(30, read=30)) as s:
                    for line in s.iter_lines():
                        if line == "data: [DONE]":
                            ended = "done"
                        elif line.startswith("data: ") and "error" in json.loads(line[6:]):
                            ended = "error event"
                        elif line.startswith("data: "):
                            tokens += 1
                            if kill and tokens == 1:
                                os.kill(rpc_pid, signal.SIGKILL)
                                killed_at = time.monotonic()
            except httpx.HTTPError as e:
                ended = f"error {type(e).__name__}"
            return time.monotonic() - killed_at, tokens, ended

        _, full, how = stream(kill=False)
        assert how == "done" and full > 1000, (how, full)
        assert _split_ready(admin) is not None

        after, tokens, how = stream(kill=True)
        killed = time.monotonic() - after
        assert how != "done" and tokens < full, f"the stream ran to its end ({tokens} events)"
        assert after < LOST_WITHIN_S, f"the stream ended {after:.1f}s after the kill ({how})"

        def left_ready() -> bool:
            return all(r["state"] != "ready" for r in admin.replicas("tiny")
                       if r["id"] == replica["id"])
        until("the split replica to leave ready", left_ready,
              max(0.1, LOST_WITHIN_S - (time.monotonic() - killed)),
              last=lambda: admin.replicas("tiny"))
        left_after = time.monotonic() - killed
        again = until("a new split replica", lambda: _split_ready(admin, replica["id"]), 120,
                      last=lambda: admin.replicas("tiny"))
        assert gw.post("/v1/chat/completions", json=ASK).status_code == 200
        print(f"\nsplit replica {replica['id']} on {replica['node']} + {worker}: stream ended "
              f"{after:.2f}s after the kill ({how}), the replica left ready after "
              f"{left_after:.1f}s; placed again as {again['id']}")
