"""`llmgw gateway` as its own process, in front of the real llama-server: SIGHUP hands the
socket to a new worker and SIGTERM drains, so a bounded load of concurrent requests
(streams among them) loses none; a plain restart does lose some (the negative control)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import yaml

from llmgw.host.netaddr import free_port
from llmgw.store import Store
from tests.gateway.test_gateway import MODEL, ready
from tests.loadgen import Load, until

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@dataclass
class Gateway:
    """`llmgw gateway` on free loopback ports over a store with one ready replica."""

    root: Path
    engine: str
    port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def config(self) -> Path:
        return self.root / "server.yaml"

    def write(self) -> Gateway:
        self.root.mkdir(parents=True, exist_ok=True)
        self.config.write_text(yaml.safe_dump({
            "gateway_listen": f"127.0.0.1:{self.port}",
            "gateway_metrics_listen": f"127.0.0.1:{self.metrics_port}",
            "state_dir": str(self.root / "state"), "gateway_drain_s": 30.0}))
        store = Store(self.root / "state" / "control.db")
        store.add_model(MODEL)
        ready(store, "r1", self.engine)
        store.close()
        return self

    def start(self, argv: list[str] | None = None, **popen: object) -> Gateway:
        log = open(self.root / "gateway.log", "ab")  # noqa: SIM115 - the process owns it
        self.proc = subprocess.Popen(
            argv or [sys.executable, "-m", "llmgw", "gateway", "--config", str(self.config)],
            stdout=log, stderr=subprocess.STDOUT, **popen)  # type: ignore[call-overload]
        until(f"{self.url}/healthz to answer", lambda: httpx.get(
            f"{self.url}/healthz", timeout=1).status_code == 200, self.log)
        return self

    def log(self) -> str:
        path = self.root / "gateway.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def workers(self) -> int:
        """How many workers the log says started serving."""
        return self.log().count(" serves 127.0.0.1")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def engine(llama_server, tiny_gguf, tmp_path_factory) -> Iterator[str]:
    """Module: the real llama-server on the tiny GGUF, on a free loopback port."""
    port = free_port()
    log = open(tmp_path_factory.mktemp("engine") / "engine.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([llama_server, "-m", str(tiny_gguf[0]), "--host", "127.0.0.1",
                             "--port", str(port), "--api-key", "k", "-np", "8", "-c", "8192",
                             "--threads-http", "32"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        until("llama-server's /health", lambda: httpx.get(
            f"{url}/health", timeout=1).status_code == 200, lambda: "", 60)
        yield url
    finally:
        proc.terminate()
        proc.wait(15)


@pytest.fixture
def gateway(engine, tmp_path) -> Iterator[Gateway]:
    gw = Gateway(tmp_path / "gw", engine).write()
    try:
        yield gw
    finally:
        gw.stop()


@dataclass
class Stream:
    """A stream of `tokens` tokens read in a thread: `began` is set at its first chunk, and
    `text` holds what it read (or the error it met) once it ends. (The tiny engine writes
    400 tokens in about 0.15 s and 1,000 in 0.45 s here.)"""

    url: str
    tokens: int = 400
    began: threading.Event = field(default_factory=threading.Event)
    text: str = ""
    thread: threading.Thread | None = None

    def start(self) -> Stream:
        self.thread = threading.Thread(target=self._read)
        self.thread.start()
        return self

    def _read(self) -> None:
        body = {**CHAT, "stream": True, "max_tokens": self.tokens, "ignore_eos": True}
        chunks: list[str] = []
        try:
            with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=body,
                              timeout=60) as r:
                for chunk in r.iter_text():
                    chunks.append(chunk)
                    self.began.set()
        except httpx.HTTPError as e:
            chunks.append(f"{type(e).__name__}: {e}")
        self.text = "".join(chunks)
        self.began.set()

    @property
    def ended(self) -> bool:
        return self.thread is not None and not self.thread.is_alive()

    def join(self, timeout_s: float) -> str:
        assert self.thread is not None
        self.thread.join(timeout_s)
        return self.text


def test_sighup_hands_over_to_new_workers_and_loses_no_request(gateway) -> None:
    """Three handovers under load: every answer whole, a long stream across them too."""
    gateway.start()
    assert gateway.proc is not None
    with Load(gateway.url) as load:
        load.wait_for(20)
        stream = Stream(gateway.url).start()
        for n in range(2, 5):
            gateway.proc.send_signal(signal.SIGHUP)
            until(f"worker {n} to serve", lambda n=n: gateway.workers() >= n, gateway.log)
            load.wait_for(20)
        streamed = stream.join(60)
    assert load.failures == [], f"{len(load.failures)} of {load.done}: {load.failures[:5]}"
    assert load.done >= 80
    assert "data: [DONE]" in streamed and streamed.count("data: ") > 100, (
        streamed[-300:], gateway.log())
    assert "drained and exited" in gateway.log()


def test_a_plain_restart_under_the_same_load_loses_requests(gateway) -> None:
    """The negative control: stop the gateway and start it again, and clients see refused
    connections (what SIGHUP, or a socket held by systemd, avoids)."""
    gateway.start()
    with Load(gateway.url) as load:
        load.wait_for(20)
        gateway.stop()
        gateway.start()
        load.wait_for(20)
    assert any("ConnectError" in f for f in load.failures), load.failures[:5]


def test_a_restart_with_the_socket_held_outside_loses_no_request(gateway) -> None:
    """As systemd's llmgw-gateway.socket does: the test holds the listening socket and
    hands it down as fd 3 ($LISTEN_FDS); stopping and starting `llmgw gateway` leaves
    connections waiting in the backlog, and none is lost."""
    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    held.bind(("127.0.0.1", gateway.port))
    held.listen(4096)
    argv = ["bash", "-c", 'exec 3<&"$HELD"; export LISTEN_PID=$$ LISTEN_FDS=1; exec "$@"',
            "sh", sys.executable, "-m", "llmgw", "gateway", "--config", str(gateway.config)]
    env = {**os.environ, "HELD": str(held.fileno())}
    try:
        gateway.start(argv, pass_fds=[held.fileno()], env=env)
        assert "(socket from systemd)" in gateway.log()
        with Load(gateway.url) as load:
            load.wait_for(20)
            gateway.stop()
            gateway.start(argv, pass_fds=[held.fileno()], env=env)
            load.wait_for(20)
        assert load.failures == [], f"{len(load.failures)} of {load.done}: {load.failures[:5]}"
    finally:
        gateway.stop()
        held.close()


def test_sigterm_finishes_a_stream_under_way_then_exits(gateway) -> None:
    """SIGTERM with a stream half read: the stream ends whole, then the gateway exits 0
    and its port refuses."""
    gateway.start()
    assert gateway.proc is not None
    stream = Stream(gateway.url, tokens=1000).start()
    assert stream.began.wait(30), gateway.log()
    gateway.proc.send_signal(signal.SIGTERM)
    assert not stream.ended, "the stream ended before SIGTERM: it proves nothing"
    assert gateway.proc.wait(40) == 0, gateway.log()
    streamed = stream.join(10)
    assert "data: [DONE]" in streamed, (streamed[-300:], gateway.log())
    assert json.loads(streamed.split("data: ")[1])["model"] == "tiny"
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{gateway.url}/healthz", timeout=2)
