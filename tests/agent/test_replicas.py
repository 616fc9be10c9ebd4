"""The replica supervisor against the real llama-server and a tiny GGUF."""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from llmgw.agent.replicas.process import pid_is_engine, stop_engines, terminate
from llmgw.agent.replicas.supervisor import ReplicaSupervisor

pytestmark = pytest.mark.slow


def assignment(url: str, sha256: str = "", rid: str = "r-1", ctx: int = 512) -> dict:
    return {"id": rid, "model": "tiny", "profile": "cpu", "engine": "llamacpp",
            "gpu_class": "", "source": url, "sha256": sha256,
            "args": ["--ctx-size", str(ctx), "--threads", "1"]}


def until(what: str, predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def state_of(sup: ReplicaSupervisor, rid: str = "r-1") -> dict:
    return next(r for r in sup.report() if r["id"] == rid)


@pytest.fixture
def supervisor(tmp_path, llama_server):
    made: list[ReplicaSupervisor] = []

    def make() -> ReplicaSupervisor:
        sup = ReplicaSupervisor(state_dir=tmp_path / "agent", weights_dir=tmp_path / "weights",
                                engine=lambda kind: llama_server, bind_host="127.0.0.1",
                                interface="lo")
        made.append(sup)
        return sup

    yield make
    stop_engines(tmp_path / "agent")


def engines_on(port: int) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and pid_is_engine(int(proc.name), port):
            found.append(int(proc.name))
    return found


def test_starts_serves_with_its_key_and_sets_nccl_interface(supervisor, served_gguf) -> None:
    sup = supervisor()
    url, digest = served_gguf
    sup.reconcile([assignment(url, digest)])
    until("ready", lambda: state_of(sup)["state"] == "ready")
    r = state_of(sup)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    url = f"{r['endpoint']}/v1/chat/completions"
    assert httpx.post(url, json=body, timeout=30).status_code == 401
    ok = httpx.post(url, json=body, headers={"Authorization": f"Bearer {r['api_key']}"},
                    timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] > 0
    env = Path(f"/proc/{r['pid']}/environ").read_bytes().split(b"\0")
    assert b"NCCL_SOCKET_IFNAME=lo" in env and b"GLOO_SOCKET_IFNAME=lo" in env
    # A CPU profile: no GPU visible to it and none asked for (llama.cpp offloads otherwise).
    assert b"CUDA_VISIBLE_DEVICES=" in env
    argv = Path(f"/proc/{r['pid']}/cmdline").read_bytes().split(b"\0")
    assert argv[argv.index(b"--device") + 1] == b"none"


def test_a_new_supervisor_adopts_the_running_engine_ready_at_once(supervisor, served_gguf) -> None:
    first = supervisor()
    first.reconcile([assignment(*served_gguf)])
    until("ready", lambda: state_of(first)["state"] == "ready")
    before = state_of(first)
    port = int(before["endpoint"].rsplit(":", 1)[1])
    second = supervisor()  # as after the agent was killed and restarted
    assert state_of(second)["state"] == "ready", "ready from the first report"
    second.reconcile([assignment(*served_gguf)])
    assert state_of(second)["pid"] == before["pid"]
    assert engines_on(port) == [before["pid"]], "no second llama-server"


def test_a_killed_engine_comes_back_by_itself(supervisor, served_gguf) -> None:
    sup = supervisor()
    sup.reconcile([assignment(*served_gguf)])
    until("ready", lambda: state_of(sup)["state"] == "ready")
    pid = state_of(sup)["pid"]
    os.kill(pid, signal.SIGKILL)
    until("failed", lambda: state_of(sup)["state"] in ("failed", "starting"), 10)
    until("ready again", lambda: state_of(sup)["state"] == "ready"
          and state_of(sup)["pid"] != pid, 60)


def test_a_removed_assignment_stops_its_engine(supervisor, served_gguf, tmp_path) -> None:
    """The engine stops and its record goes; its log stays for `llmgw logs`."""
    sup = supervisor()
    sup.reconcile([assignment(*served_gguf)])
    until("started", lambda: state_of(sup)["pid"] > 0)
    pid = state_of(sup)["pid"]
    sup.reconcile([])
    assert sup.report() == []
    for retiring in list(sup.retiring.values()):
        retiring.join(timeout=60)
    assert not Path(f"/proc/{pid}").exists() or not pid_is_engine(pid, 0)
    assert not list((tmp_path / "agent" / "replicas").glob("*.json"))


def _long_answer(r: dict, out: list) -> None:
    """A completion of a second or more on the tiny model (about 2,000 tokens), streamed;
    out gets its outcome."""
    body = {"messages": [{"role": "user", "content": "count"}], "max_tokens": 3000,
            "stream": True, "ignore_eos": True}
    try:
        with httpx.stream("POST", f"{r['endpoint']}/v1/chat/completions", json=body,
                          headers={"Authorization": f"Bearer {r['api_key']}"},
                          timeout=120) as response:
            text = "".join(response.iter_text())
        out.append((response.status_code, text.rstrip().endswith("data: [DONE]")))
    except httpx.HTTPError as e:
        out.append(("cut", repr(e)))


def _port(r: dict) -> int:
    return int(r["endpoint"].rsplit(":", 1)[1])


def _stopped_mid_answer(sup, served_gguf, stop) -> tuple[dict, list]:  # type: ignore[no-untyped-def]
    """A ready replica, a long streamed answer under way, then stop(replica) 0.3 s in: the
    replica and the answer's outcome once its client is done."""
    sup.reconcile([assignment(*served_gguf, ctx=4096)])
    until("ready", lambda: state_of(sup)["state"] == "ready")
    r = state_of(sup)
    out: list = []
    streaming = threading.Thread(target=_long_answer, args=(r, out))
    streaming.start()
    time.sleep(0.3)
    stop(r)
    streaming.join(timeout=120)
    return r, out


def test_a_replica_taken_off_finishes_the_answer_under_way_then_stops(
        supervisor, served_gguf) -> None:
    """Moved elsewhere, a replica's engine stops once its slots are idle, not mid-answer."""
    sup = supervisor()
    retiring: list = []
    r, out = _stopped_mid_answer(sup, served_gguf, lambda r: retiring.append(sup.stop("r-1")))
    assert retiring[0] is not None
    retiring[0].join(timeout=60)
    assert out == [(200, True)], out
    assert not pid_is_engine(r["pid"], _port(r))


def test_negative_control_an_engine_stopped_at_once_cuts_the_answer(
        supervisor, served_gguf) -> None:
    sup = supervisor()
    _, out = _stopped_mid_answer(sup, served_gguf, lambda r: terminate(r["pid"], _port(r)))
    assert out and out[0] != (200, True), out
    kept = sup.facts()["replica_logs"]["r-1"]
    assert any("llama" in line.lower() for line in kept), "the stopped engine's log is gone"


def test_wrong_digest_fails_naming_both(supervisor, served_gguf) -> None:
    sup = supervisor()
    url, digest = served_gguf
    wrong = hashlib.sha256(b"other").hexdigest()
    sup.reconcile([assignment(url, wrong)])
    until("failed", lambda: state_of(sup)["state"] == "failed", 10)
    err = state_of(sup)["err"]
    assert digest in err and wrong in err
