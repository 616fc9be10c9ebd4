"""One model split over a main node and a worker through the agents' TLS relay
(llmgw.agent.rpc_relay), with the real engines: llama-server with --rpc on the main side,
rpc-server on the worker, certificates made at test time, the worker's relay on its own
loopback address (127.0.0.2, standing for its management address)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from llmgw.agent import rpc_relay
from llmgw.agent.client import AgentClient
from llmgw.agent.replicas import rpc_argv
from llmgw.agent.replicas.split import MainShare, WorkerShare
from llmgw.agent.revocation import RevocationError, Revocations, kept_fresh
from llmgw.agent.rpc_relay import MainRelay, Worker, WorkerRelay
from llmgw.config import TLSFiles
from llmgw.control.agent_api import AgentAPI, AgentAPIServer, mtls_context
from llmgw.errors import Unreachable
from llmgw.host import pki
from llmgw.store import Store
from tests.agent.cluster_pki import Cluster
from tests.tiny_gguf import write_tiny_gguf

WORKER_ADDR = "127.0.0.2"
PROMPT = "The quick brown fox jumps over the lazy dog. "
TOKENS = 24
# Logprobs of the split and the unsplit engine may differ by float rounding where a layer's
# sums run in another order; measured: identical on this build (0.0).
LOGPROB_TOLERANCE = 1e-3
WAIT_S = 60.0


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _wait(what: str, check: object, timeout: float = WAIT_S, last: object = None) -> None:
    __tracebackhide__ = True
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return
        time.sleep(0.1)
    state = last() if callable(last) else ""
    pytest.fail(f"waited {timeout:.0f}s for {what}; last state: {state}")


def _port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        socket.create_connection((host, port), timeout=0.5).close()
        return True
    except OSError:
        return False


@dataclass
class Proc:
    proc: subprocess.Popen[bytes]
    log: Path
    port: int

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def _spawn(argv: list[str], log: Path, port: int) -> Proc:
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    return Proc(proc, log, port)


def _engine(binary: str, model: Path, tmp: Path, name: str, extra: list[str]) -> Proc:
    port = _free_port()
    p = _spawn([binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
                "-c", "512", "-np", "1", "-t", "1", "--no-warmup", "-v", *extra],
               tmp / f"{name}.log", port)

    def healthy() -> bool:
        if p.proc.poll() is not None:
            return True
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    _wait(f"{name} to answer /health", healthy, last=lambda: p.text()[-1500:])
    assert p.proc.poll() is None, f"{name} exited: {p.text()[-3000:]}"
    return p


def _complete(port: int) -> tuple[str, list[float]]:
    r = httpx.post(f"http://127.0.0.1:{port}/completion", timeout=60, json={
        "prompt": PROMPT, "n_predict": TOKENS, "temperature": 0, "n_probs": 1,
        "cache_prompt": False, "seed": 1})
    r.raise_for_status()
    body = r.json()
    probs = [p.get("logprob", p.get("prob", 0.0)) for p in body["completion_probabilities"]]
    return body["content"], probs


def _buffers(log: str) -> dict[str, float]:
    """llama.cpp's `<device> model buffer size = N MiB` lines, by device."""
    found = {}
    for line in log.splitlines():
        if "model buffer size" in line:
            head, _, size = line.partition("model buffer size =")
            found[head.split(":", 1)[-1].strip()] = float(size.split()[0])
    return found


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Module: the tiny GGUF."""
    path = tmp_path_factory.mktemp("split") / "tiny.gguf"
    write_tiny_gguf(path)
    return path


@dataclass
class Split:
    rpc: Proc
    worker: WorkerRelay
    main: MainRelay
    flags: list[str]
    tmp: Path


@pytest.fixture
def split(rpc_engine: tuple[str, str], cluster: Cluster, tmp_path: Path) -> Iterator[Split]:
    """Function: worker-1's share (rpc-server on loopback, its relay on 127.0.0.2 admitting
    main-1) and main-1's (its relay to worker-1, the engine's flags: one layer there);
    stopped afterwards."""
    worker = WorkerShare(Path(rpc_engine[1]), cluster.files["worker-1"], host=WORKER_ADDR,
                         main_node="main-1", profile_args=["--threads", "1"],
                         log_path=tmp_path / "rpc-server.log")
    port = worker.start()
    assert worker.proc is not None
    main = MainShare(cluster.files["main-1"], [Worker("worker-1", WORKER_ADDR, port)], 1)
    flags = main.start()
    try:
        yield Split(Proc(worker.proc, worker.log_path, worker.port), worker.relay, main.relay,
                    flags, tmp_path)
    finally:
        main.stop()
        worker.stop()


def test_a_split_model_answers_as_the_unsplit_one_and_the_worker_holds_its_share(
        rpc_engine: tuple[str, str], model: Path, split: Split) -> None:
    """At temperature 0 the model split over main-1 and worker-1 (its last layer on the
    worker's rpc-server, through both relays) answers the same text as the model on one
    engine, logprobs within LOGPROB_TOLERANCE; the engine's log shows a model buffer on the
    RPC device and one on the CPU (each node holds a share), and the relay carried at least
    the RPC buffer's bytes. The control: another model (another seed) answers otherwise,
    so the comparison can fail."""
    alone = _engine(rpc_engine[0], model, split.tmp, "alone", [])
    try:
        text, probs = _complete(alone.port)
    finally:
        alone.stop()
    engine = _engine(rpc_engine[0], model, split.tmp, "split",
                     split.flags)
    try:
        split_text, split_probs = _complete(engine.port)
    finally:
        engine.stop()
    assert split_text == text
    assert len(split_probs) == len(probs)
    assert max(abs(a - b) for a, b in zip(split_probs, probs, strict=True)) <= LOGPROB_TOLERANCE
    buffers = _buffers(engine.text())
    rpc_buffers = {k: v for k, v in buffers.items() if k.startswith("RPC")}
    assert rpc_buffers and all(v > 0 for v in rpc_buffers.values()), buffers
    assert max(buffers.get("CPU", 0), buffers.get("CPU_Mapped", 0)) > 0, buffers
    assert split.main.counters.carried >= 1 and split.worker.counters.carried >= 1
    assert split.main.counters.bytes_in >= sum(rpc_buffers.values()) * 1024 * 1024 * 0.9
    assert "Accepted client connection" in split.rpc.text()

    other = split.tmp / "other.gguf"
    write_tiny_gguf(other, seed=1)
    control = _engine(rpc_engine[0], other, split.tmp, "control", [])
    try:
        assert _complete(control.port)[0] != text
    finally:
        control.stop()


def _handshake(files: TLSFiles, port: int) -> bytes:
    """Connect to the worker's relay with files' certificate, send an RPC-like byte and
    read what comes back: b'' when the relay closed the connection."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.load_cert_chain(files.cert, files.key)
    with socket.create_connection((WORKER_ADDR, port), timeout=5) as raw:
        with ctx.wrap_socket(raw) as tls:
            try:
                tls.sendall(b"\x00" * 8)
                tls.settimeout(2)
                return tls.recv(16)
            except (ssl.SSLError, ConnectionError):
                return b""
            except TimeoutError:
                return b"(open)"


def _refused_or_closed(files: TLSFiles, port: int) -> bool:
    """Whether the relay failed the handshake or closed the connection unanswered (under
    TLS 1.3 the client's side of the handshake ends before the server has checked the
    client's certificate: its refusal comes as an alert on the first read)."""
    try:
        return _handshake(files, port) == b""
    except (ssl.SSLError, ConnectionError):
        return True


def test_the_worker_admits_only_the_assigned_main_and_nothing_else_reaches_rpc_server(
        cluster: Cluster, split: Split) -> None:
    """A peer with another CA's certificate (even one naming main-1) fails the handshake;
    one with this cluster's certificate for another node is closed unread: rpc-server saw
    no connection. The control: main-1's own certificate is carried to rpc-server, whose
    log then says so (so the log would show a refused peer had one reached it)."""
    port = split.worker.port
    assert _refused_or_closed(cluster.files["foreign-main-1"], port)
    assert _handshake(cluster.files["intruder"], port) == b""
    time.sleep(0.5)
    assert any("names node 'intruder'" in r for r in split.worker.counters.refused)
    assert split.worker.counters.carried == 0
    assert "Accepted client connection" not in split.rpc.text()

    _handshake(cluster.files["main-1"], port)  # what rpc-server answers 8 zero bytes is its own
    _wait("rpc-server to log the assigned main's connection",
          lambda: "Accepted client connection" in split.rpc.text(), timeout=10,
          last=split.rpc.text)
    assert split.worker.counters.carried == 1


def test_the_main_relay_refuses_a_worker_that_is_not_the_node_it_expects(
        cluster: Cluster, split: Split) -> None:
    """The main side checks the worker's certificate itself (node certificates are
    clientAuth ones): a relay that expects worker-2 at worker-1's address carries nothing.
    The control is the split fixture's own relay, expecting worker-1, which carries."""
    wrong = MainRelay(cluster.files["main-1"], [Worker("worker-2", WORKER_ADDR,
                                                       split.worker.port)])
    (port,) = wrong.start()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.settimeout(5)
            assert s.recv(16) == b""
        assert wrong.counters.refused and "not 'worker-2'" in wrong.counters.refused[0]
        assert wrong.counters.carried == 0
    finally:
        wrong.stop()
    (good,) = split.main.ports
    with socket.create_connection(("127.0.0.1", good), timeout=5):
        _wait("the main relay to carry a connection", lambda: split.main.counters.carried == 1,
              timeout=10)


def _listening(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp and tcp6 write them) in LISTEN on port."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            addr, hexport = fields[1].rsplit(":", 1)
            if int(hexport, 16) == port and fields[3] == "0A":
                found.append(addr)
    return found


def test_rpc_server_listens_on_loopback_only(split: Split) -> None:
    """The socket table holds rpc-server's port in LISTEN on 127.0.0.1 (0100007F) and on
    nothing else. The control: a socket bound to 0.0.0.0 shows as 00000000 in the same
    reading, so a wider bind would be seen."""
    assert _listening(split.rpc.port) == ["0100007F"]
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        assert _listening(s.getsockname()[1]) == ["00000000"]


def test_a_lost_worker_ends_the_stream_in_flight_within_seconds(
        rpc_engine: tuple[str, str], model: Path, split: Split) -> None:
    """The worker's rpc-server killed at the first token of a long stream: the stream ends
    within 10 s without its normal last event (`stop: true`), and the main engine stops
    serving rather than go on without a share of its weights. The control: the same stream,
    nothing killed, runs to that last event with all its tokens."""
    engine = _engine(rpc_engine[0], model, split.tmp, "split",
                     ["-c", "2048", *split.flags])
    body = {"prompt": PROMPT, "n_predict": 1500, "temperature": 0, "stream": True,
            "ignore_eos": True, "cache_prompt": False}

    def stream(kill: bool) -> tuple[float, int, str]:
        killed_at = time.monotonic()
        tokens, ended = 0, "cut"
        try:
            with httpx.stream("POST", f"http://127.0.0.1:{engine.port}/completion", json=body,
                              timeout=httpx.Timeout(30, read=30)) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    event = json.loads(line[len("data: "):])
                    tokens += 1
                    if event.get("stop"):
                        ended = "stop"
                    if kill and tokens == 1:
                        split.rpc.proc.send_signal(signal.SIGKILL)
                        killed_at = time.monotonic()
        except httpx.HTTPError as e:
            ended = f"error {type(e).__name__}"
        return time.monotonic() - killed_at, tokens, ended

    try:
        _, full, how = stream(kill=False)
        assert how == "stop" and full > 1000, (how, full)
        after_kill, tokens, how = stream(kill=True)
        assert how != "stop" and tokens < full, \
            f"the stream ran to its end ({tokens} events) after its worker was killed"
        assert after_kill < 10, f"the stream ended {after_kill:.1f}s after the kill ({how})"
        _wait("the main engine to stop or refuse", lambda: engine.proc.poll() is not None
              or not _serves(engine.port), timeout=10, last=lambda: engine.text()[-800:])
    finally:
        engine.stop()


def _serves(port: int) -> bool:
    try:
        r = httpx.post(f"http://127.0.0.1:{port}/completion", timeout=5,
                       json={"prompt": "a", "n_predict": 2})
        return r.status_code == 200
    except httpx.HTTPError:
        return False


def test_rpc_server_gets_only_the_threads_flag_of_a_profile() -> None:
    """The profile's args reach rpc-server only through engine_args' list (its threads);
    its address is the agent's: loopback. The control: the same args' --threads reaches it."""
    argv = rpc_argv.rpc_server_command("/x/rpc-server", 5000,
                                        ["-c", "4096", "--threads", "3", "-ngl", "9"])
    assert argv[argv.index("/x/rpc-server"):] == [
        "/x/rpc-server", "--host", "127.0.0.1", "--port", "5000", "--threads", "3"]
    assert json.dumps(argv).count("--host") == 1


def test_a_worker_whose_rpc_server_does_not_listen_says_so_and_opens_no_relay(
        cluster: Cluster, tmp_path: Path) -> None:
    """An rpc-server that exits at once: start() raises naming the address it waited for
    and the log, and no relay listens on the management address. The control: the relay's
    own port was free before (nothing else held it)."""
    broken = tmp_path / "rpc-server"
    broken.write_text("#!/bin/sh\necho 'error: no devices' >&2\nexit 3\n")
    broken.chmod(0o755)
    relay_port = _free_port(WORKER_ADDR)
    share = WorkerShare(broken, cluster.files["worker-1"], host=WORKER_ADDR,
                        main_node="main-1", profile_args=[], log_path=tmp_path / "rpc.log",
                        relay_port=relay_port)
    with pytest.raises(rpc_relay.RelayError, match=r"rpc-server did not listen on 127\.0\.0\.1"
                       r":\d+ within \d+s \(exit 3\); see .*rpc\.log"):
        share.start()
    assert not _port_open(relay_port, WORKER_ADDR)
    assert "no devices" in (tmp_path / "rpc.log").read_text()


@dataclass
class Upstream:
    """A TCP server on loopback standing where rpc-server stands (the relay carries bytes,
    whatever they say): it echoes what it reads, or, with echo False, only holds each
    connection; conns are the accepted ones."""

    sock: socket.socket
    echo: bool
    conns: list[socket.socket]

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    def serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            if self.echo:
                threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := conn.recv(1 << 20):
                conn.sendall(data)


@contextlib.contextmanager
def _relayed(cluster: Cluster, echo: bool) -> Iterator[tuple[Upstream, WorkerRelay, MainRelay]]:
    up = Upstream(socket.create_server(("127.0.0.1", 0)), echo, [])
    threading.Thread(target=up.serve, daemon=True).start()
    worker = WorkerRelay(cluster.files["worker-1"], host=WORKER_ADDR, upstream_port=up.port,
                         main_node="main-1")
    main = MainRelay(cluster.files["main-1"], [Worker("worker-1", WORKER_ADDR, worker.start())])
    main.start()
    try:
        yield up, worker, main
    finally:
        main.stop()
        worker.stop()
        up.sock.close()
        for c in up.conns:
            c.close()


def _read(sock: socket.socket, n: int) -> bytes:
    got = bytearray()
    while len(got) < n and (chunk := sock.recv(n - len(got))):
        got += chunk
    return bytes(got)


def test_megabytes_cross_both_relays_unchanged_each_way(cluster: Cluster) -> None:
    """8 MiB of random bytes (eight 1 MiB answers' worth, as the logits of a large
    vocabulary come back) written through the main relay, the TLS leg and the worker's relay
    to an echoing upstream come back byte for byte, and each end counted them each way; a
    small write after them comes back too (nothing held back behind a big one). The
    control: a copy with one byte changed differs from what came back, so the comparison
    sees a single wrong byte."""
    payload = os.urandom(8 << 20)
    with _relayed(cluster, echo=True) as (_, worker, main):
        with socket.create_connection(("127.0.0.1", main.ports[0]), timeout=30) as s:
            writer = threading.Thread(target=s.sendall, args=(payload,), daemon=True)
            writer.start()
            back = _read(s, len(payload))
            writer.join(30)
            s.sendall(b"ping")
            assert _read(s, 4) == b"ping"
        assert back == payload
        changed = bytearray(payload)
        changed[len(payload) // 2] ^= 1
        assert back != bytes(changed)
        total = len(payload) + 4
        for relay in (main, worker):
            assert relay.counters.bytes_in == total and relay.counters.bytes_out == total
        assert main.cpu_seconds() > 0 and worker.cpu_seconds() > 0


def test_either_side_closing_closes_the_other_and_stop_ends_a_carried_connection(
        cluster: Cluster) -> None:
    """The engine's connection closed: the upstream's ends (EOF) within seconds; the
    upstream's closed: the engine's ends; a relay stopped with a connection open ends it.
    The control: while both sides stay open, a read on either waits (no EOF)."""
    with _relayed(cluster, echo=False) as (up, worker, main):
        def carried(n: int) -> socket.socket:
            s = socket.create_connection(("127.0.0.1", main.ports[0]), timeout=5)
            _wait(f"connection {n} to reach the upstream", lambda: len(up.conns) >= n,
                  timeout=10, last=lambda: (main.counters, worker.counters))
            up.conns[n - 1].settimeout(5)
            return s

        engine = carried(1)
        engine.settimeout(0.5)
        with pytest.raises(TimeoutError):
            engine.recv(1)
        up.conns[0].settimeout(0.5)
        with pytest.raises(TimeoutError):
            up.conns[0].recv(1)
        up.conns[0].settimeout(5)
        engine.close()
        assert up.conns[0].recv(1) == b""

        engine = carried(2)
        engine.settimeout(5)
        up.conns[1].close()
        assert engine.recv(1) == b""
        engine.close()

        engine = carried(3)
        engine.settimeout(5)
        worker.stop()
        assert engine.recv(1) == b""
        assert up.conns[2].recv(1) == b""
        engine.close()


# --- the cluster's revocation list ---


def _serial(files: TLSFiles) -> str:
    return pki.serial_hex(pki.load_cert(files.cert))


@dataclass
class ControlPlane:
    """A real agent API (its CA key held, so it issues revocation lists) and the agent
    client worker-1 fetches them with."""

    server: AgentAPIServer
    client: AgentClient


@pytest.fixture
def control_plane(cluster: Cluster, tmp_path: Path) -> Iterator[ControlPlane]:
    """Function: the control plane's agent API on a free loopback port (its store in
    tmp_path), and worker-1's AgentClient to it; stopped afterwards."""
    cert, key = pki.issue_server(cluster.ca, ["127.0.0.1"]).write(tmp_path, "server")
    tls = (cluster.files["worker-1"].ca, str(cert), str(key))
    store = Store(tmp_path / "control.db")
    server = AgentAPIServer("127.0.0.1", 0, mtls_context(*tls), AgentAPI(store, cluster.ca),
                            tls=tls)
    server.start()
    client = AgentClient(f"https://127.0.0.1:{server.port}", cluster.files["worker-1"])
    try:
        yield ControlPlane(server, client)
    finally:
        client.close()
        server.stop()
        store.close()


@pytest.fixture
def rpc_server(rpc_engine: tuple[str, str], tmp_path: Path) -> Iterator[Proc]:
    """Function: the real rpc-server on a free loopback port, its log in tmp_path."""
    port = _free_port()
    p = _spawn(rpc_argv.rpc_server_command(rpc_engine[1], port, ["--threads", "1"]),
               tmp_path / "rpc-server.log", port)
    try:
        _wait("rpc-server to listen", lambda: _port_open(port) or p.proc.poll() is not None,
              timeout=30, last=p.text)
        assert p.proc.poll() is None, p.text()
        yield p
    finally:
        p.stop()


def test_a_revoked_main_is_refused_in_the_handshake_and_nothing_reaches_rpc_server(
        cluster: Cluster, control_plane: ControlPlane, rpc_server: Proc) -> None:
    """main-1 removed (its serial revoked on the control plane), the list fetched by
    worker-1's agent client: the worker's relay refuses main-1 in the TLS handshake
    (OpenSSL's `certificate revoked`), and rpc-server logs no connection. The control:
    with the list fetched before the revocation, the same main-1 is carried to rpc-server
    (so its log would show a refused peer had one reached it)."""
    revocations = Revocations(cluster.files["worker-1"].ca)
    assert not revocations.refresh(control_plane.client.revocation_list)
    assert revocations.crl_file() is not None and not revocations.serials
    relay = WorkerRelay(cluster.files["worker-1"], host=WORKER_ADDR,
                        upstream_port=rpc_server.port, main_node="main-1",
                        revocations=revocations)
    port = relay.start()
    try:
        _handshake(cluster.files["main-1"], port)
        _wait("rpc-server to log main-1's connection",
              lambda: "Accepted client connection" in rpc_server.text(), timeout=10,
              last=rpc_server.text)
        assert relay.counters.carried == 1 and not relay.counters.refused
        accepted = rpc_server.text().count("Accepted client connection")

        control_plane.server.revoke([_serial(cluster.files["main-1"])])
        assert revocations.refresh(control_plane.client.revocation_list)
        assert _refused_or_closed(cluster.files["main-1"], port)
        _wait("the relay to refuse main-1 in the handshake",
              lambda: any("certificate revoked" in r for r in relay.counters.refused),
              timeout=5, last=lambda: relay.counters.refused)
        time.sleep(0.5)
        assert relay.counters.carried == 1
        assert rpc_server.text().count("Accepted client connection") == accepted
    finally:
        relay.stop()
        revocations.stop()


def test_a_list_that_revokes_a_carried_peer_closes_its_connection_on_both_sides(
        cluster: Cluster, control_plane: ControlPlane) -> None:
    """A connection carried main-1 -> worker-1 ends (EOF at the engine and at the
    upstream) once a newer list revoking main-1 is taken by the worker's agent, and the
    main's relay closes its connection to worker-1 once its agent takes a list revoking
    worker-1, and refuses the next (not carried: the engine's bytes never leave). The
    controls: the same connections stay open (a read waits) while the lists taken revoke
    neither, here one revoking another node."""
    up = Upstream(socket.create_server(("127.0.0.1", 0)), False, [])
    threading.Thread(target=up.serve, daemon=True).start()
    at_worker = Revocations(cluster.files["worker-1"].ca)
    at_main = Revocations(cluster.files["main-1"].ca)
    worker = WorkerRelay(cluster.files["worker-1"], host=WORKER_ADDR, upstream_port=up.port,
                         main_node="main-1", revocations=at_worker)
    main = MainRelay(cluster.files["main-1"], [Worker("worker-1", WORKER_ADDR, worker.start())],
                     revocations=at_main)
    (port,) = main.start()

    def carried(n: int) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        _wait(f"connection {n} to reach the upstream", lambda: len(up.conns) >= n,
              timeout=10, last=lambda: (main.counters, worker.counters))
        up.conns[n - 1].settimeout(5)
        s.settimeout(0.5)
        return s

    try:
        engine = carried(1)
        control_plane.server.revoke([_serial(cluster.files["intruder"])])
        assert at_worker.refresh(control_plane.client.revocation_list)
        with pytest.raises(TimeoutError):
            engine.recv(1)
        control_plane.server.revoke([_serial(cluster.files["main-1"])])
        assert at_worker.refresh(control_plane.client.revocation_list)
        engine.settimeout(5)
        assert engine.recv(1) == b"" and up.conns[0].recv(1) == b""
        assert any("revoked while carried" in r for r in worker.counters.refused)

        # The main's side: worker-1 revoked in the list main-1's agent holds.
        worker.stop()
        at_worker.stop()
        at_worker = Revocations(cluster.files["worker-1"].ca)
        worker = WorkerRelay(cluster.files["worker-1"], host=WORKER_ADDR,
                             upstream_port=up.port, main_node="main-1",
                             revocations=at_worker, port=worker.port)
        worker.start()
        engine = carried(2)
        with pytest.raises(TimeoutError):
            engine.recv(1)
        at_main.update(pki.make_crl(cluster.ca, [_serial(cluster.files["worker-1"])]))
        engine.settimeout(5)
        assert engine.recv(1) == b"" and up.conns[1].recv(1) == b""
        assert any("revoked while carried" in r for r in main.counters.refused)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.settimeout(5)
            assert s.recv(1) == b""
        assert "was revoked" in main.counters.refused[-1]
        assert main.counters.carried == 2, "the refused one was never carried"
    finally:
        main.stop()
        worker.stop()
        at_worker.stop()
        at_main.stop()
        up.sock.close()
        for c in up.conns:
            c.close()


def test_a_list_not_signed_by_the_cluster_ca_is_refused_and_the_held_one_stays(
        cluster: Cluster) -> None:
    """A list from another CA naming main-1's serial is refused (RevocationError naming
    why) and revokes nothing; the control: the same serial in a list the cluster CA
    signed is taken."""
    revocations = Revocations(cluster.files["worker-1"].ca)
    main_1 = pki.load_cert(cluster.files["main-1"].cert)
    try:
        with pytest.raises(RevocationError, match="not signed by this node's cluster CA"):
            revocations.update(pki.make_crl(pki.create_ca("another cluster"),
                                            [_serial(cluster.files["main-1"])]))
        assert not revocations.revoked(main_1) and revocations.crl_file() is None
        assert revocations.update(pki.make_crl(cluster.ca, [_serial(cluster.files["main-1"])]))
        assert revocations.revoked(main_1)
    finally:
        revocations.stop()


def test_the_agents_list_is_kept_fresh_from_the_control_plane(
        cluster: Cluster, control_plane: ControlPlane) -> None:
    """kept_fresh (what run_agent starts) fetches the list at once and again every
    every_s: a node removed on the control plane afterwards is revoked in the agent's list
    within a few periods, and a listener (a relay) is told. The control: before the
    removal the list held revokes nothing."""
    main_1 = pki.load_cert(cluster.files["main-1"].cert)
    told = threading.Event()
    revocations = kept_fresh(control_plane.client.revocation_list,
                             cluster.files["worker-1"].ca, every_s=0.2)
    revocations.on_change(told.set)
    try:
        _wait("the first list", lambda: revocations.crl_file() is not None, timeout=10)
        assert not revocations.revoked(main_1) and not told.is_set()
        control_plane.server.revoke([_serial(cluster.files["main-1"])])
        _wait("main-1 to be revoked in the agent's list", lambda: revocations.revoked(main_1),
              timeout=10, last=lambda: revocations.serials)
        assert told.wait(5)
    finally:
        revocations.stop()


def test_a_control_plane_away_leaves_the_held_list_in_force_and_is_said_once(
        cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    """A fetch that fails keeps the list held (main-1 stays revoked) and is logged once
    for a run of failures, then once more when a fetch succeeds again. The control: the
    list held revokes main-1 before the failures, so its staying so is the list's doing."""
    revocations = Revocations(cluster.files["worker-1"].ca)
    main_1 = pki.load_cert(cluster.files["main-1"].cert)
    crl = pki.make_crl(cluster.ca, [_serial(cluster.files["main-1"])])

    def away() -> bytes:
        raise Unreachable("the control plane at https://cp:7443 did not answer")

    try:
        assert revocations.refresh(lambda: crl) and revocations.revoked(main_1)
        with caplog.at_level("INFO", logger="llmgw.agent.revocation"):
            for _ in range(3):
                assert not revocations.refresh(away)
            assert revocations.revoked(main_1)
            assert not revocations.refresh(lambda: crl)
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 2 and "did not answer" in said[0] and "stays in force" in said[0]
        assert "fresh again (1 revoked)" in said[1]
    finally:
        revocations.stop()
