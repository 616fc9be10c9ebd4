"""Models on demand on a real fleet: a control plane, its gateway and one node running
llama.cpp on CPU, all on loopback. A model at scaling.min 0 loads on its first request,
once however many ask; an idle replica goes and its engine exits; a node with room for two
models evicts the least recently used idle one for a third, never one with a stream in
flight; a model that cannot load answers every waiting request 503 with why; a client that
hangs up leaves the load queue. One fleet for the module: each test has its own models."""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmgw.config import render
from llmgw.control.client import AdminClient
from llmgw.host import admin_token
from tests.fleet.cluster import Agent, ControlPlane

pytestmark = pytest.mark.slow

LOAD_WAIT_S = 60.0
# The module's gateway port, set by the fleet fixture (add() waits until it lists a model).
_gateway_port: list[int] = [0]


def until(what: str, probe: Callable[[], Any], timeout_s: float = 90.0,
          last: Callable[[], Any] | None = None) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        found = probe()
        if found:
            return found
        assert time.monotonic() < deadline, (
            f"timed out after {timeout_s:.0f} s waiting for {what}; "
            f"last: {last() if last else found}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, llama_server: str) -> Iterator[dict[str, Any]]:
    """Module: a control plane with its gateway (load_wait_s 60) and one ready node, n1."""
    root = tmp_path_factory.mktemp("on-demand")
    cp = ControlPlane(root / "cp", node_timeout_s=10.0)
    cp.config = cp.config.model_copy(update={"load_wait_s": LOAD_WAIT_S})
    cp.server_yaml.write_text(render(cp.config, "a test control plane"))
    cp.start()
    _gateway_port[0] = cp.ports["gateway"]
    admin = cp.admin_client()
    agent = Agent(root / "n1", "n1", cp.agent_api, cp.issue("n1", root / "n1" / "pki"),
                  llama_server=llama_server, heartbeat_s=0.5).start()
    try:
        until("n1 ready", lambda: [n for n in admin.nodes() if n["state"] == "ready"], 300,
              last=lambda: (admin.nodes(), agent.log()[-1500:]))
        yield {"cp": cp, "admin": admin, "agent": agent, "root": root}
    finally:
        agent.stop()
        agent.stop_engines()
        admin.close()
        cp.stop()


def add(admin: AdminClient, name: str, source: str, digest: str, *, idle_s: int = 0,
        memory_gb: float = 0, selector: dict[str, str] | None = None, **more: Any) -> None:
    """Add a model at scaling.min 0, then wait until the gateway lists it (its table is
    read every 0.5 s: a request sent within the same milliseconds may not find it)."""
    admin.add_model({**more, "name": name, "source": source, "sha256": digest,
                     "scaling": {"min": 0, "max": 1, "idle_s": idle_s},
                     "profiles": [{"name": "cpu", "engine": "llamacpp",
                                   "min_memory_gb": memory_gb,
                                   "node_selector": selector or {},
                                   "args": ["--ctx-size", "2048", "--threads", "1"]}]})
    gateway = f"http://127.0.0.1:{_gateway_port[0]}"
    until(f"the gateway to list {name}", lambda: name in [
        m["id"] for m in httpx.get(f"{gateway}/v1/models", timeout=5).json()["data"]], 5)


def ask(model: str, **more: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "temperature": 0, **more}


def replicas(admin: AdminClient, model: str) -> list[dict[str, Any]]:
    return list(admin.replicas(model))


def live(admin: AdminClient, model: str) -> list[dict[str, Any]]:
    return [r for r in admin.replicas(model) if r["state"] != "stopped"]


def state(admin: AdminClient, model: str) -> str:
    return next(m["state"] for m in admin.models() if m["name"] == model)


def gauge(cp: ControlPlane, model: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{cp.ports['gateway-metrics']}/metrics", timeout=5).text
    found = re.search(rf'^llmgw_requests_waiting_for_load\{{model="{model}"\}} (\S+)$', text,
                      re.M)
    return float(found.group(1)) if found else 0.0


def engine_pid(agent: Agent, replica_id: str) -> int:
    record = agent.root / "state" / "replicas" / f"{replica_id}.json"
    return int(json.loads(record.read_text())["pid"])


def exited(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def test_thirty_first_requests_load_a_model_at_zero_once_and_all_get_200(
        fleet: dict[str, Any], served_gguf: tuple[str, str]) -> None:
    """Nothing runs for a min-0 model before its first request (it is listed, idle); 30
    concurrent first requests, one of them a stream, start exactly one replica and all get
    200."""
    admin, cp = fleet["admin"], fleet["cp"]
    add(admin, "cold", *served_gguf)
    time.sleep(2)  # two scheduler ticks: a min-0 model gets no replica on its own
    assert replicas(admin, "cold") == [] and state(admin, "cold") == "idle"
    listed = httpx.get(f"{cp.gateway}/v1/models", timeout=10).json()["data"]
    assert "cold" in [m["id"] for m in listed]

    def one(i: int) -> tuple[int, str]:
        body = ask("cold", stream=(i == 0))
        r = httpx.post(f"{cp.gateway}/v1/chat/completions", json=body, timeout=120)
        return r.status_code, r.text[:300]

    started = time.monotonic()
    with ThreadPoolExecutor(30) as pool:
        answers = list(pool.map(one, range(30)))
    took = time.monotonic() - started
    assert [s for s, _ in answers] == [200] * 30, answers
    assert "data: " in answers[0][1]  # the stream came as a stream
    made = replicas(admin, "cold")
    assert len(made) == 1, made
    assert state(admin, "cold") == "serving"
    print(f"\n30 first requests for a model at zero: all 200 in {took:.1f} s, "
          f"one replica ({made[0]['id']})")


def test_an_idle_replica_is_removed_and_its_engine_exits(
        fleet: dict[str, Any], served_gguf: tuple[str, str]) -> None:
    """A replica with no request for scaling.idle_s (3 s here) is stopped and its engine
    process exits; before idle_s it serves."""
    admin, cp, agent = fleet["admin"], fleet["cp"], fleet["agent"]
    add(admin, "napper", *served_gguf, idle_s=3)
    r = httpx.post(f"{cp.gateway}/v1/chat/completions", json=ask("napper"), timeout=120)
    assert r.status_code == 200, r.text
    (replica,) = live(admin, "napper")
    pid = engine_pid(agent, replica["id"])
    assert not exited(pid)  # control: right after its request it runs
    gone = until("the idle replica stopped", lambda: not live(admin, "napper"), 30,
                 last=lambda: live(admin, "napper"))
    stopped = next(r for r in replicas(admin, "napper") if r["id"] == replica["id"])
    assert stopped["state"] == "stopped" and "scaling.idle_s 3" in stopped["err"], stopped
    until(f"engine pid {pid} to exit", lambda: exited(pid), 30)
    assert gone and state(admin, "napper") == "idle"


class HeldStream:
    """A stream whose client reads its head and then nothing: the gateway holds it in
    flight (its socket to the client full) until the client reads on or hangs up."""

    def __init__(self, port: int, model: str) -> None:
        body = json.dumps(ask(model, stream=True, max_tokens=1900,
                              ignore_eos=True)).encode()
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.settimeout(120)
        self.sock.connect(("127.0.0.1", port))
        self.sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                          b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        self.head = self.sock.recv(1024)

    def close(self) -> None:
        self.sock.close()


def test_a_third_model_evicts_the_least_recently_used_idle_one_never_a_streaming_one(
        fleet: dict[str, Any], served_gguf: tuple[str, str]) -> None:
    """n1 has room for two of these models (each takes 40% of its memory). Asking for a
    third evicts the least recently used idle one, named in its stop reason; a model with a
    stream in flight is never evicted, and once that stream is over (the control), it is."""
    admin, cp = fleet["admin"], fleet["cp"]
    (n1,) = admin.nodes()
    size = round(n1["memory_mb"] / 1024 * 0.4, 2)
    for name in ("ev-a", "ev-b", "ev-c"):
        add(admin, name, *served_gguf, memory_gb=size)
    gw = httpx.Client(base_url=cp.gateway, timeout=120)
    with gw:
        for name in ("ev-a", "ev-b"):
            assert gw.post("/v1/chat/completions", json=ask(name)).status_code == 200
        (a,) = live(admin, "ev-a")
        # ev-a is the least recently used: asking for ev-c evicts it.
        assert gw.post("/v1/chat/completions", json=ask("ev-c")).status_code == 200
        evicted = next(r for r in replicas(admin, "ev-a") if r["id"] == a["id"])
        assert evicted["state"] == "stopped", evicted
        assert f"evicted replica {a['id']} of ev-a on n1 for ev-c" in evicted["err"], evicted
        assert live(admin, "ev-b") and live(admin, "ev-c")

        # A stream in flight on ev-b (the least recently used now): ev-a must take ev-c's room.
        held = HeldStream(cp.ports["gateway"], "ev-b")
        try:
            assert held.head.startswith(b"HTTP/1.1 200"), held.head
            time.sleep(3)  # the gateway's report of ev-b in flight reaches the store
            assert gw.post("/v1/chat/completions", json=ask("ev-a")).status_code == 200
            assert live(admin, "ev-b"), "ev-b was evicted with a stream in flight"
            assert not live(admin, "ev-c")
        finally:
            held.close()
        # Control: the stream over, ev-b is the least recently used idle one, and goes.
        time.sleep(3)
        assert gw.post("/v1/chat/completions", json=ask("ev-c")).status_code == 200
        assert not live(admin, "ev-b") and live(admin, "ev-a")
    token = admin_token.read_token(cp.token_path)
    metrics = httpx.get(f"{cp.admin}/metrics", timeout=10,
                        headers={"Authorization": f"Bearer {token}"}).text
    assert 'llmgw_evictions_total{reason="no_room"} 3.0' in metrics


def test_a_corrupt_model_answers_every_waiting_request_503_with_why_at_once(
        fleet: dict[str, Any], served_gguf: tuple[str, str], tiny_gguf: tuple[Path, str]
) -> None:
    """A model whose file is no GGUF: its engine exits, and every request waiting for it
    gets 503 naming why within 5 s of the failure (not at load_wait_s, 60 s)."""
    import hashlib

    admin, cp = fleet["admin"], fleet["cp"]
    path = tiny_gguf[0].parent / "corrupt.gguf"
    path.write_bytes(b"GGUF" + os.urandom(4096))
    source = served_gguf[0].rsplit("/", 1)[0] + "/corrupt.gguf"
    add(admin, "broken", source, hashlib.sha256(path.read_bytes()).hexdigest())
    failed_at: list[float] = []
    stop = threading.Event()

    def watch() -> None:
        """When the store first shows the replica failed (its watch goes on after the
        answers came: the gateway, polling the store itself, may see it first)."""
        deadline = time.monotonic() + 90
        while not stop.is_set() and not failed_at and time.monotonic() < deadline:
            if any(r["state"] == "failed" for r in replicas(admin, "broken")):
                failed_at.append(time.time())
            time.sleep(0.1)

    def one(_: int) -> tuple[int, str, float]:
        r = httpx.post(f"{cp.gateway}/v1/chat/completions", json=ask("broken"), timeout=120)
        return r.status_code, r.text, time.time()

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(one, range(3)))
        watcher.join(15)
    finally:
        stop.set()
        watcher.join()
    assert [s for s, _, _ in answers] == [503] * 3, answers
    for _, text, at in answers:
        assert "failed to load" in text and "broken" in text, text
        assert failed_at and at - failed_at[0] < 5.0, (at, failed_at)
    print(f"\n503s came {max(at for *_, at in answers) - failed_at[0]:.1f} s after the "
          f"replica was seen failed: {answers[0][1][:300]}")


def test_a_client_that_hangs_up_leaves_the_load_queue(
        fleet: dict[str, Any], served_gguf: tuple[str, str]) -> None:
    """A request waiting for a load whose client hangs up leaves the queue at once: the
    waiting gauge drops to 0 (the model here never loads: its file's server never answers)."""
    admin, cp = fleet["admin"], fleet["cp"]
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts into its backlog, never answers
    source = f"http://127.0.0.1:{silent.getsockname()[1]}/slow.gguf"
    # Its size given: the admin API reads no header from the silent server.
    add(admin, "slowpoke", source, "a" * 64, size_bytes=1 << 20)
    body = json.dumps(ask("slowpoke")).encode()
    try:
        with socket.create_connection(("127.0.0.1", cp.ports["gateway"])) as client:
            client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                           b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            client.settimeout(0.01)

            def seen() -> tuple[float, bytes]:
                try:
                    answered = client.recv(4096)
                except TimeoutError:
                    answered = b""
                return gauge(cp, "slowpoke"), answered

            until("the request waiting for slowpoke's load", lambda: gauge(cp, "slowpoke") == 1,
                  10, last=seen)
            until("slowpoke loading", lambda: state(admin, "slowpoke") == "loading", 10,
                  last=lambda: live(admin, "slowpoke"))
        hung_up = time.monotonic()
        until("the waiting gauge to drop", lambda: gauge(cp, "slowpoke") == 0, 5,
              last=lambda: gauge(cp, "slowpoke"))
        print(f"\nthe waiting gauge dropped {time.monotonic() - hung_up:.2f} s after the "
              "hang-up")
    finally:
        silent.close()
        admin.delete_model("slowpoke")


def test_with_no_control_plane_a_cold_model_is_refused_at_once(
        fleet: dict[str, Any], served_gguf: tuple[str, str]) -> None:
    """The control plane stopped (the gateway goes on): a request for a model with no ready
    replica gets 503 saying no control plane schedules, at once; a serving model is still
    served. Last in the module: it restarts the control plane after."""
    admin, cp = fleet["admin"], fleet["cp"]
    add(admin, "orphan", *served_gguf)
    add(admin, "kept", *served_gguf)
    assert httpx.post(f"{cp.gateway}/v1/chat/completions", json=ask("kept"),
                      timeout=120).status_code == 200
    from tests.fleet.cluster import _stop
    _stop(cp.proc)
    try:
        started = time.monotonic()
        r = httpx.post(f"{cp.gateway}/v1/chat/completions", json=ask("orphan"), timeout=120)
        took = time.monotonic() - started
        assert r.status_code == 503 and "no control plane is scheduling" in r.text, r.text
        assert took < LOAD_WAIT_S / 2, took
        assert httpx.post(f"{cp.gateway}/v1/chat/completions", json=ask("kept"),
                          timeout=30).status_code == 200
    finally:
        cp.proc = None
        cp.start()
