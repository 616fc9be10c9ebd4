"""The agent API's server against hostile clients: bodies that never come, connections
that never say hello, and request heads that frame a body two ways. Real TLS on loopback,
with certificates made here; the deadlines are set short in each test's own limits."""

from __future__ import annotations

import logging
import socket
import ssl
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from llmgw.agent.client import AgentClient
from llmgw.config import AGENT_LIMITS, TLSFiles
from llmgw.contract import AgentPaths
from llmgw.control.agent_api import AgentAPI, AgentAPIServer, mtls_context
from llmgw.host import pki
from llmgw.store import Store

# How long past a deadline a test waits for the close it promises: the machine is shared,
# and a deadline's timer fires late when the loop is busy.
MARGIN_S = 4.0
SHORT_S = 1.0
LONG_S = 60.0


@dataclass
class Cluster:
    """A cluster CA with its key, the server's certificate and one node's, in dir."""

    dir: Path
    ca: pki.KeyPair
    node: tuple[str, str]

    @property
    def ca_file(self) -> str:
        return str(self.dir / "ca.pem")

    def tls(self) -> tuple[str, str, str]:
        return self.ca_file, str(self.dir / "server.pem"), str(self.dir / "server-key.pem")

    def node_files(self) -> TLSFiles:
        return TLSFiles(ca=self.ca_file, cert=self.node[0], key=self.node[1])



@pytest.fixture
def cluster(tmp_path: Path) -> Cluster:
    """Function: a CA, a server certificate for 127.0.0.1 and node-a's client certificate,
    written to tmp_path."""
    ca = pki.create_ca()
    ca.write(tmp_path, "ca")
    pki.issue_server(ca, ["127.0.0.1", "localhost"]).write(tmp_path, "server")
    cert, key = pki.issue_client(ca, "node-a").write(tmp_path, "node-a")
    return Cluster(tmp_path, ca, (str(cert), str(key)))


@dataclass
class Served:
    server: AgentAPIServer
    store: Store

    @property
    def port(self) -> int:
        return self.server.port


_DEADLINES = {"body_s": "body_window_s", "first_byte_s": "first_byte_timeout_s",
              "handshake_s": "handshake_timeout_s"}


def _limits(**deadlines: float) -> dict[str, Any]:
    """AgentAPIServer's limits with these deadlines (body_s: the body's rate window, its
    first one the grace a body has to begin), the agent API's defaults otherwise."""
    settings = {_DEADLINES[name]: value for name, value in deadlines.items()}
    return {"limits": replace(AGENT_LIMITS, **settings)}


@contextmanager
def agent_api(cluster: Cluster, **deadlines: float) -> Iterator[Served]:
    """A real agent API (with the CA key: it signs joins) on a free loopback port, with
    these deadlines, for the length of the block."""
    store = Store(cluster.dir / f"control-{time.monotonic_ns()}.db")
    tls = cluster.tls()
    server = AgentAPIServer("127.0.0.1", 0, mtls_context(*tls), AgentAPI(store, cluster.ca),
                            tls=tls, **_limits(**deadlines))
    server.start()
    try:
        yield Served(server, store)
    finally:
        server.stop()
        store.close()


def connect(port: int, cluster: Cluster, cert: tuple[str, str] | None) -> ssl.SSLSocket:
    """A TLS connection to the agent API, showing cert (or no certificate)."""
    ctx = ssl.create_default_context(cafile=cluster.ca_file)
    if cert:
        ctx.load_cert_chain(*cert)
    raw = socket.create_connection(("127.0.0.1", port), timeout=5)
    return ctx.wrap_socket(raw, server_hostname="127.0.0.1")


def read_until_closed(sock: socket.socket, within_s: float) -> tuple[bytes, bool]:
    """What the server sent, and whether it closed the connection within within_s."""
    deadline = time.monotonic() + within_s
    data = b""
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        except (ConnectionError, ssl.SSLError):
            return data, True
        if not chunk:
            return data, True
        data += chunk
    return data, False


def statuses(data: bytes) -> list[int]:
    """The status of every answer in data, in order."""
    return [int(line.split(b" ")[1]) for line in data.split(b"\r\n")
            if line.startswith(b"HTTP/1.1 ")]


# --- a body that never comes ---

HANGING = "Host: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n"


@pytest.mark.parametrize("with_cert", [True, False], ids=["node", "no certificate"])
@pytest.mark.parametrize("path", [AgentPaths.HEARTBEAT, AgentPaths.JOIN])
def test_a_body_that_never_comes_is_closed_by_the_body_deadline(
        cluster: Cluster, path: str, with_cert: bool) -> None:
    """Content-Length: 100000 and then nothing: the connection is closed by the body
    deadline (within its margin), with or without a client certificate, and nothing is
    processed. Without a certificate on a path that needs one, the 401 comes from the head
    at once, no body waited for."""
    with agent_api(cluster, body_s=SHORT_S) as api, \
            connect(api.port, cluster, cluster.node if with_cert else None) as conn:
        conn.sendall(f"POST {path} HTTP/1.1\r\n{HANGING}".encode())
        data, closed = read_until_closed(conn, SHORT_S + MARGIN_S)
        assert closed, f"still open {SHORT_S + MARGIN_S:.0f} s after the head; got {data!r}"
        assert not any(200 <= s < 300 for s in statuses(data)), data
        if path == AgentPaths.HEARTBEAT and not with_cert:
            assert statuses(data) == [401], data
        assert api.store.nodes() == []


def test_negative_control_a_raised_body_deadline_holds_the_connection(cluster: Cluster) -> None:
    """The same hanging body with the deadline raised: still open when the test looks."""
    with agent_api(cluster, body_s=LONG_S) as api, \
            connect(api.port, cluster, cluster.node) as conn:
        conn.sendall(f"POST {AgentPaths.HEARTBEAT} HTTP/1.1\r\n{HANGING}".encode())
        data, closed = read_until_closed(conn, SHORT_S + MARGIN_S)
        assert not closed and data == b""


def test_a_body_over_agent_https_limit_is_refused_from_its_head(cluster: Cluster) -> None:
    """A heartbeat whose Content-Length passes the agent API's max_body_bytes (agent_http;
    AGENT_LIMITS by default) is answered 413 at once and closed, nothing of it read. The
    negative control: one at the limit is waited for, unanswered."""
    limit = AGENT_LIMITS.max_body_bytes
    head = f"POST {AgentPaths.HEARTBEAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: "
    with agent_api(cluster) as api:
        with connect(api.port, cluster, cluster.node) as conn:
            conn.sendall(f"{head}{limit + 1}\r\n\r\n".encode())
            data, closed = read_until_closed(conn, MARGIN_S)
            assert statuses(data) == [413] and closed, data
        with connect(api.port, cluster, cluster.node) as conn:
            conn.sendall(f"{head}{limit}\r\n\r\n".encode())
            assert read_until_closed(conn, SHORT_S) == (b"", False)


# --- connections that never say hello ---

def client_hello() -> bytes:
    """The first flight of a real TLS client: one record holding its ClientHello."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    out = ssl.MemoryBIO()
    tls = ctx.wrap_bio(ssl.MemoryBIO(), out, server_hostname="127.0.0.1")
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    hello = out.read()
    assert hello[:2] == b"\x16\x03" and len(hello) == 5 + int.from_bytes(hello[3:5], "big")
    return hello


def hostile_connections(stack: ExitStack, port: int, silent: int, partial: int,
                        whole: int = 0) -> list[socket.socket]:
    """silent connections that send nothing, partial ones that send half a ClientHello and
    whole ones that send a whole ClientHello, each then silent; closed with the stack."""
    hello = client_hello()
    sent = [b""] * silent + [hello[:len(hello) // 2]] * partial + [hello] * whole
    socks = []
    for data in sent:
        sock = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=5))
        if data:
            sock.sendall(data)
        socks.append(sock)
    return socks


def still_open(sock: socket.socket) -> bool:
    """Whether the server has not closed sock (nothing to read, no EOF, no reset)."""
    sock.setblocking(False)
    try:
        return bool(sock.recv(1, socket.MSG_PEEK)) or False
    except BlockingIOError:
        return True
    except ConnectionError:
        return False
    finally:
        sock.setblocking(True)


def test_250_silent_or_half_done_handshakes_do_not_keep_a_node_out(cluster: Cluster) -> None:
    """150 connections that sent nothing and 100 that sent half a ClientHello, all held
    open (the first-byte deadline raised past the test): a node's new connection, with its
    certificate, is answered at once, and the 250 are still there when it is."""
    with agent_api(cluster, first_byte_s=LONG_S, handshake_s=LONG_S) as api, \
            ExitStack() as stack:
        hostile = hostile_connections(stack, api.port, silent=150, partial=100)
        time.sleep(0.5)  # the server has taken them all in
        client = AgentClient(f"https://127.0.0.1:{api.port}", cluster.node_files(),
                             timeout=MARGIN_S)
        try:
            started = time.monotonic()
            answer = client.heartbeat({})
            took = time.monotonic() - started
        finally:
            client.close()
        assert answer["node_id"] == "node-a" and took < MARGIN_S
        assert all(still_open(s) for s in hostile), "the hostile connections were let go first"


def test_negative_control_whole_hellos_that_stall_do_hold_the_handshake_slots(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """The slots are real: with one slot, a connection whose ClientHello came whole and
    then stalled holds it until the handshake deadline; a node waits that long, then is
    answered."""
    from llmgw.control import _tlsserver

    monkeypatch.setattr(_tlsserver, "HANDSHAKES_AT_ONCE", 1)
    monkeypatch.setattr(_tlsserver, "HANDSHAKE_TIMEOUT_S", 2.0)
    with agent_api(cluster, handshake_s=2.0) as api, ExitStack() as stack:
        hostile_connections(stack, api.port, silent=0, partial=0, whole=1)
        time.sleep(0.3)
        client = AgentClient(f"https://127.0.0.1:{api.port}", cluster.node_files(),
                             timeout=10)
        try:
            started = time.monotonic()
            answer = client.heartbeat({})
            took = time.monotonic() - started
        finally:
            client.close()
        assert answer["node_id"] == "node-a"
        assert took > 1.0, f"answered in {took:.2f} s: the stalled handshake held no slot"


@pytest.mark.parametrize("kind", ["silent", "partial"])
def test_a_connection_without_a_whole_hello_is_closed_by_the_first_byte_deadline(
        cluster: Cluster, kind: str) -> None:
    """One that sends nothing, and one that sends half a ClientHello, are closed by the
    first-byte deadline (within its margin); with the deadline raised (the control) both
    are still open when the test looks."""
    for deadline_s, closes in ((SHORT_S, True), (LONG_S, False)):
        with agent_api(cluster, first_byte_s=deadline_s) as api, ExitStack() as stack:
            sock, = hostile_connections(stack, api.port, silent=int(kind == "silent"),
                                        partial=int(kind == "partial"))
            _, closed = read_until_closed(sock, SHORT_S + MARGIN_S)
            assert closed == closes, (f"first-byte deadline {deadline_s} s: "
                                      f"{'closed' if closed else 'open'} after "
                                      f"{SHORT_S + MARGIN_S} s")


# --- heads that frame a body two ways ---

BEAT = AgentPaths.HEARTBEAT
HIDDEN = (f"POST {BEAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 12\r\n\r\n"
          '{"cpus": 99}')


@pytest.mark.parametrize("head, body", [
    pytest.param(f"Content-Length: {len(HIDDEN) + 2}\r\nContent-Length: 2", "{}" + HIDDEN,
                 id="two Content-Length lines"),
    pytest.param("Content-Length: 1_0", '{"cpus":1}', id="1_0"),
    pytest.param("Content-Length: +5", "{}   ", id="+5"),
    pytest.param("Content-Length: \x0b5", "{}   ", id="vertical tab"),
    pytest.param("Content-Length: \xa05", "{}   ", id="no-break space"),
    pytest.param("Content-Length:\r\n 10", '{"cpus":1}', id="folded Content-Length"),
    pytest.param("Transfer-Encoding:\r\n chunked\r\nContent-Length: 10", '{"cpus":1}',
                 id="folded Transfer-Encoding"),
    pytest.param("X-A: 1\nContent-Length: 10", '{"cpus":1}', id="bare-LF-led Content-Length"),
    pytest.param("X-A: 1\nTransfer-Encoding: chunked\r\nContent-Length: 10", '{"cpus":1}',
                 id="bare-LF-led Transfer-Encoding"),
    pytest.param("Transfer-Encoding: gzip\r\nContent-Length: 10", '{"cpus":1}',
                 id="Transfer-Encoding gzip with a length"),
    pytest.param("Content-Length: -5", "{}   ", id="negative length"),
])
def test_a_head_that_frames_its_body_badly_is_refused_and_nothing_processed(
        cluster: Cluster, caplog: pytest.LogCaptureFixture, head: str, body: str) -> None:
    """400 (501 for a coding it does not know), the connection closed, no heartbeat
    recorded, no second answer, and no traceback in the log."""
    caplog.set_level(logging.WARNING)
    with agent_api(cluster) as api, connect(api.port, cluster, cluster.node) as conn:
        conn.sendall(f"POST {BEAT} HTTP/1.1\r\nHost: 127.0.0.1\r\n{head}\r\n\r\n{body}"
                     .encode("latin-1"))
        data, closed = read_until_closed(conn, MARGIN_S)
        nodes = api.store.nodes()
    assert statuses(data) in ([400], [501]), data
    assert closed, "the connection stayed open after a malformed head"
    assert nodes == [], "a heartbeat was processed"
    assert not [r for r in caplog.records if r.exc_info], caplog.text


def test_negative_control_a_well_framed_heartbeat_is_processed(cluster: Cluster) -> None:
    """The same helper with one plain Content-Length: 200, and the node recorded."""
    with agent_api(cluster) as api, connect(api.port, cluster, cluster.node) as conn:
        conn.sendall(f"POST {BEAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                     'Content-Length: 10\r\n\r\n{"cpus":1}'.encode())
        data, closed = read_until_closed(conn, MARGIN_S)
        assert statuses(data) == [200] and closed, data
        assert [n["id"] for n in api.store.nodes()] == ["node-a"]
