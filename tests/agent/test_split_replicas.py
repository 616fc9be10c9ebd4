"""A replica split over two nodes, each run by its own ReplicaSupervisor as its agent would
(main-1 on 127.0.0.1, worker-1 with its management address 127.0.0.2), given the
assignments the control plane sends (contract.records.SplitMain, SplitShare): the real
llama-server and rpc-server of the source build with the RPC backend, the tiny GGUF over
http, certificates made at test time."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmgw.agent.replicas.process import stop_engines
from llmgw.agent.replicas.split import WorkerShare
from llmgw.agent.replicas.supervisor import ReplicaSupervisor
from tests.agent.cluster_pki import Cluster
from tests.tiny_gguf import write_tiny_gguf

pytestmark = pytest.mark.slow

WORKER_ADDR = "127.0.0.2"
WAIT_S = 60.0
# The bound the issue sets on a lost worker: the stream in flight ends, the replica leaves
# ready.
LOST_WITHIN_S = 10.0
# One layer of the tiny GGUF: 64x64 attention weights four times, 64x128 feed-forward three
# times, f32.
WORKER_LAYER_BYTES = (4 * 64 * 64 + 3 * 64 * 128) * 4
CHAT = {"messages": [{"role": "user", "content": "The quick brown fox"}],
        "max_tokens": 24, "temperature": 0, "seed": 1, "cache_prompt": False}


def until(what: str, check: Callable[[], bool], timeout_s: float = WAIT_S,
          last: Callable[[], object] = lambda: "") -> float:
    """Waits for check; the seconds it took. Fails naming what and the last state."""
    __tracebackhide__ = True
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout_s:
            pytest.fail(f"waited {timeout_s:.0f}s for {what}; last state: {last()}")
        time.sleep(0.1)
    return time.monotonic() - start


def report(sup: ReplicaSupervisor, rid: str) -> dict[str, Any]:
    return dict(next(r for r in sup.report() if r["id"] == rid))


def plain(rid: str, source: tuple[str, str], ctx: int = 512) -> dict[str, Any]:
    """An assignment of the tiny model on one node (CPU)."""
    return {"id": rid, "model": "tiny", "profile": "cpu", "engine": "llamacpp",
            "gpu_class": "", "source": source[0], "sha256": source[1],
            "args": ["--ctx-size", str(ctx), "--threads", "1"]}


def worker_part(rid: str, source: tuple[str, str], main: str = "main-1") -> dict[str, Any]:
    """worker-1's part: one of the model's two layers, for main."""
    return {**plain(rid, source), "split": {"role": "worker", "main": main, "layers": 1}}


def main_part(rid: str, source: tuple[str, str], relay_port: int,
              ctx: int = 512) -> dict[str, Any]:
    return {**plain(rid, source, ctx), "split": {"role": "main", "workers": [
        {"node": "worker-1", "layers": 1, "addr": WORKER_ADDR, "port": relay_port}]}}


class Nodes:
    """Supervisors standing for nodes' agents: make(name) gives one with that node's
    certificate and address (worker-1: WORKER_ADDR), and the RPC build unless rpc is False
    (a node whose engine has no rpc-server). close() takes every replica away from each
    and stops what is left."""

    def __init__(self, root: Path, cluster: Cluster, engine: tuple[str, str]) -> None:
        self.root, self.cluster, self.engine = root, cluster, engine
        self.made: list[ReplicaSupervisor] = []

    def make(self, name: str, *, rpc: bool = True, state: str = "") -> ReplicaSupervisor:
        state_dir = self.root / (state or f"{name}-{len(self.made)}")
        sup = ReplicaSupervisor(
            state_dir=state_dir, weights_dir=state_dir / "weights",
            engine=lambda kind: self.engine[0],
            rpc_server=lambda kind: self.engine[1] if rpc else None,
            tls=self.cluster.files[name],
            bind_host=WORKER_ADDR if name.startswith("worker") else "127.0.0.1",
            interface="lo")
        self.made.append(sup)
        return sup

    def close(self) -> None:
        for sup in reversed(self.made):  # mains (made last) before their workers
            sup.reconcile([])
            for t in list(sup.retiring.values()):
                t.join(30)
            stop_engines(sup.dir.parent)


@pytest.fixture
def nodes(tmp_path: Path, cluster: Cluster, rpc_engine: tuple[str, str]) -> Iterator[Nodes]:
    """Function: a factory of node supervisors (Nodes); all stopped afterwards."""
    made = Nodes(tmp_path, cluster, rpc_engine)
    yield made
    made.close()


def ready_worker(sup: ReplicaSupervisor, rid: str, source: tuple[str, str],
                 main: str = "main-1") -> int:
    """worker-1 given its part of rid, until ready; its relay's port."""
    sup.reconcile([worker_part(rid, source, main)])
    until(f"worker-1's part of {rid} to be ready", lambda: report(sup, rid)["state"] == "ready",
          last=lambda: report(sup, rid))
    return int(report(sup, rid)["relay_port"])


def chat(endpoint: str, key: str, body: dict[str, Any] = CHAT) -> str:
    r = httpx.post(f"{endpoint}/v1/chat/completions", json=body, timeout=60,
                   headers={"Authorization": f"Bearer {key}"})
    r.raise_for_status()
    return str(r.json()["choices"][0]["message"]["content"])


def served(sup: ReplicaSupervisor, rid: str, timeout_s: float = WAIT_S) -> dict[str, Any]:
    until(f"{rid} to be ready", lambda: report(sup, rid)["state"] == "ready", timeout_s,
          last=lambda: report(sup, rid))
    return report(sup, rid)


def log_of(sup: ReplicaSupervisor, rid: str) -> str:
    return (sup.dir / f"{rid}.log").read_text(errors="replace")


@dataclass
class Split:
    """A replica split over main-1 and worker-1 (module), ready."""

    main: ReplicaSupervisor
    worker: ReplicaSupervisor
    rid: str
    relay_port: int


@pytest.fixture(scope="module")
def split(tmp_path_factory: pytest.TempPathFactory, cluster: Cluster,
          rpc_engine: tuple[str, str], served_gguf: tuple[str, str]) -> Iterator[Split]:
    """Module: replica r-split over main-1 and worker-1 through their relays, ready; its
    parts stopped afterwards."""
    made = Nodes(tmp_path_factory.mktemp("split"), cluster, rpc_engine)
    try:
        worker = made.make("worker-1")
        port = ready_worker(worker, "r-split", served_gguf)
        main = made.make("main-1")
        main.reconcile([main_part("r-split", served_gguf, port)])
        served(main, "r-split")
        yield Split(main, worker, "r-split", port)
    finally:
        made.close()


def test_the_split_replica_answers_as_the_unsplit_model(
        split: Split, nodes: Nodes, served_gguf: tuple[str, str],
        tiny_gguf: tuple[Path, str]) -> None:
    """At temperature 0 the main's endpoint (its key) answers a chat completion with the
    same text as the same model on one node; the worker's relay carried at least a layer's
    weights to rpc-server, which logged the main's connection. The control: another model
    (another seed, served beside it) answers otherwise, so the comparison can fail."""
    r = report(split.main, split.rid)
    split_text = chat(r["endpoint"], r["api_key"])
    share = split.worker.replicas[split.rid].share
    assert isinstance(share, WorkerShare)
    assert share.relay.counters.bytes_in > WORKER_LAYER_BYTES, share.relay.counters
    assert "Accepted client connection" in log_of(split.worker, split.rid)

    other_digest = write_tiny_gguf(tiny_gguf[0].parent / "other.gguf", seed=1)
    other = (served_gguf[0].rsplit("/", 1)[0] + "/other.gguf", other_digest)
    alone = nodes.make("main-1")
    alone.reconcile([plain("r-alone", served_gguf), plain("r-other", other)])
    a, o = served(alone, "r-alone"), served(alone, "r-other")
    assert split_text == chat(a["endpoint"], a["api_key"])
    assert split_text != chat(o["endpoint"], o["api_key"])


def test_the_worker_reports_its_relay_and_downloads_nothing(split: Split) -> None:
    """worker-1's report: ready, no endpoint, the port its relay listens on at its
    management address (which answers a connection there); its part fetched no weights,
    and rpc-server listens on 127.0.0.1 only. The control: main-1 downloaded the model into
    its weights folder, and reports an endpoint and no relay port."""
    w = report(split.worker, split.rid)
    assert w["state"] == "ready" and w["endpoint"] == "" and w["relay_port"] == split.relay_port
    socket.create_connection((WORKER_ADDR, w["relay_port"]), timeout=5).close()
    assert not list(split.worker.weights_dir.glob("**/*.gguf"))
    m = report(split.main, split.rid)
    assert list(split.main.weights_dir.glob("**/*.gguf"))
    assert m["endpoint"].startswith("http://127.0.0.1:") and "relay_port" not in m
    share = split.worker.replicas[split.rid].share
    assert isinstance(share, WorkerShare)
    listening = [line.split()[1] for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
                 if line.split()[3] == "0A" and int(line.split()[1].rsplit(":", 1)[1], 16)
                 == share.port]
    assert listening == [f"0100007F:{share.port:04X}"]


def test_a_worker_assigned_another_main_refuses_this_one_and_its_replica_fails(
        split: Split, nodes: Nodes, served_gguf: tuple[str, str]) -> None:
    """worker-1 told its main is main-2: main-1's relay is refused after the handshake
    (the worker's relay names why), rpc-server sees no connection, and main-1's part of the
    replica fails naming worker-1. The control: the module's split, whose worker was told
    main-1, carried main-1 to rpc-server and serves."""
    worker = nodes.make("worker-1")
    port = ready_worker(worker, "r-wrong", served_gguf, main="main-2")
    main = nodes.make("main-1")
    main.reconcile([main_part("r-wrong", served_gguf, port)])
    until("main-1's part to fail", lambda: report(main, "r-wrong")["state"] == "failed",
          last=lambda: report(main, "r-wrong"))
    assert "worker worker-1" in report(main, "r-wrong")["err"]
    share = worker.replicas["r-wrong"].share
    assert isinstance(share, WorkerShare)
    assert any("names node 'main-1', not 'main-2'" in why for why in share.relay.counters.refused)
    assert share.relay.counters.carried == 0
    assert "Accepted client connection" not in log_of(worker, "r-wrong")

    good = split.worker.replicas[split.rid].share
    assert isinstance(good, WorkerShare)
    assert good.relay.counters.carried >= 1
    assert not any("main-1" in why for why in good.relay.counters.refused)
    assert report(split.main, split.rid)["state"] == "ready"


def test_a_node_without_rpc_server_fails_the_part_saying_what_to_do(
        nodes: Nodes, served_gguf: tuple[str, str]) -> None:
    """A worker whose engine has no rpc-server reports its part failed, saying to build the
    engine with the RPC backend (engine.prebuilt: off). The control: the same assignment
    on a node with rpc-server is ready with a relay port."""
    bare = nodes.make("worker-1", rpc=False)
    bare.reconcile([worker_part("r-norpc", served_gguf)])
    until("the part to fail", lambda: report(bare, "r-norpc")["state"] == "failed",
          last=lambda: report(bare, "r-norpc"))
    err = report(bare, "r-norpc")["err"]
    assert "has no RPC backend" in err and "engine.prebuilt: off" in err, err
    assert "relay_port" not in report(bare, "r-norpc")

    assert ready_worker(nodes.make("worker-1"), "r-norpc", served_gguf) > 0


def test_a_part_no_longer_assigned_is_stopped_and_a_restarted_agent_does_not_adopt_one(
        nodes: Nodes, served_gguf: tuple[str, str]) -> None:
    """A worker's part taken away: rpc-server exits and its relay stops listening. A part
    left running by an agent that went away (here: a second supervisor on the same state)
    is not adopted: its rpc-server is stopped and the part reported failed saying why. The
    control: before each, rpc-server ran and the relay answered."""
    first = nodes.make("worker-1", state="w")
    port = ready_worker(first, "r-gone", served_gguf)
    proc = first.replicas["r-gone"].proc
    assert proc is not None and proc.poll() is None
    socket.create_connection((WORKER_ADDR, port), timeout=5).close()
    first.reconcile([])
    until("the part to be stopped", lambda: "r-gone" not in first.retiring, 15)
    assert proc.poll() is not None
    with pytest.raises(OSError):
        socket.create_connection((WORKER_ADDR, port), timeout=2).close()

    first.reconcile([worker_part("r-left", served_gguf)])
    until("the part to be ready", lambda: report(first, "r-left")["state"] == "ready")
    left = first.replicas["r-left"]
    assert left.proc is not None and left.proc.poll() is None
    again = nodes.make("worker-1", state="w")
    r = report(again, "r-left")
    assert r["state"] == "failed" and "not adopted" in r["err"] and "stopped" in r["err"], r
    until("the rpc-server left to exit", lambda: left.proc is not None
          and left.proc.poll() is not None, 15)
    again.reconcile([worker_part("r-left", served_gguf)])
    assert report(again, "r-left")["state"] == "failed", "a part not adopted is started again"


def test_a_killed_worker_ends_the_stream_and_fails_the_main_within_seconds(
        nodes: Nodes, served_gguf: tuple[str, str]) -> None:
    """worker-1's rpc-server killed at the first token of a long stream from main-1: the
    stream ends with an error (no normal end) within LOST_WITHIN_S, main-1 reports its part
    failed naming worker-1 within LOST_WITHIN_S of the kill, and its engine is gone; the
    worker reports its part failed (rpc-server exited). The control: the same stream, nothing
    killed, runs to its end with all its tokens and the main stays ready."""
    worker = nodes.make("worker-1")
    port = ready_worker(worker, "r-kill", served_gguf)
    main = nodes.make("main-1")
    main.reconcile([main_part("r-kill", served_gguf, port, ctx=2048)])
    r = served(main, "r-kill")
    rpc = worker.replicas["r-kill"].proc
    assert rpc is not None
    body = {**CHAT, "max_tokens": 1500, "ignore_eos": True, "stream": True}

    def stream(kill: bool) -> tuple[float, int, str]:
        killed_at = time.monotonic()
        tokens, ended = 0, "cut"
        try:
            with httpx.stream("POST", f"{r['endpoint']}/v1/chat/completions", json=body,
                              headers={"Authorization": f"Bearer {r['api_key']}"},
                              timeout=httpx.Timeout(30, read=30)) as s:
                for line in s.iter_lines():
                    if line == "data: [DONE]":
                        ended = "done"
                        continue
                    if not line.startswith("data: "):
                        continue
                    event = json.loads(line[len("data: "):])
                    if "error" in event:
                        ended = f"error event {event['error']}"
                        continue
                    tokens += 1
                    if kill and tokens == 1:
                        os.kill(rpc.pid, signal.SIGKILL)
                        killed_at = time.monotonic()
        except httpx.HTTPError as e:
            ended = f"error {type(e).__name__}"
        return time.monotonic() - killed_at, tokens, ended

    _, full, how = stream(kill=False)
    assert how == "done" and full > 1000, (how, full)
    assert report(main, "r-kill")["state"] == "ready"

    after, tokens, how = stream(kill=True)
    killed = time.monotonic() - after
    assert how != "done" and tokens < full, f"the stream ran to its end ({tokens} events)"
    assert after < LOST_WITHIN_S, f"the stream ended {after:.1f}s after the kill ({how})"
    until("main-1's part to fail", lambda: report(main, "r-kill")["state"] == "failed",
          max(0.1, LOST_WITHIN_S - (time.monotonic() - killed)),
          last=lambda: report(main, "r-kill"))
    assert "worker worker-1" in report(main, "r-kill")["err"]
    engine = main.replicas["r-kill"].proc
    assert engine is not None
    until("main-1's engine to exit", lambda: engine.poll() is not None, 15)
    until("worker-1's part to fail", lambda: report(worker, "r-kill")["state"] == "failed", 15,
          last=lambda: report(worker, "r-kill"))
    assert "rpc-server exited" in report(worker, "r-kill")["err"]
