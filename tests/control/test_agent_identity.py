"""The agent API knows a node by its verified certificate only."""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw.agent.client import AgentClient
from llmgw.config import TLSFiles
from llmgw.control.agent_api import AgentAPI, AgentAPIServer, mtls_context
from llmgw.errors import Unreachable
from llmgw.host import pki
from llmgw.store import Store


@pytest.fixture
def cluster(tmp_path: Path) -> dict[str, pki.KeyPair]:
    """Function: a cluster CA and its server certificate for 127.0.0.1, written to tmp_path."""
    ca = pki.create_ca()
    ca.write(tmp_path, "ca")
    pki.issue_server(ca, ["127.0.0.1", "localhost"]).write(tmp_path, "server")
    return {"ca": ca}


@pytest.fixture
def agent_api(tmp_path: Path, cluster: dict[str, pki.KeyPair]) -> Iterator[AgentAPIServer]:
    """Function: a real agent API on a free loopback port, its store in tmp_path."""
    store = Store(tmp_path / "control.db")
    ctx = mtls_context(str(tmp_path / "ca.pem"), str(tmp_path / "server.pem"),
                       str(tmp_path / "server-key.pem"))
    server = AgentAPIServer("127.0.0.1", 0, ctx, AgentAPI(store))
    server.start()
    server.store = store  # type: ignore[attr-defined]
    yield server
    server.stop()
    store.close()


def node_tls(tmp_path: Path, ca: pki.KeyPair, cn: str, stem: str) -> TLSFiles:
    cert, key = pki.issue_client(ca, cn).write(tmp_path, stem)
    return TLSFiles(ca=str(tmp_path / "ca.pem"), cert=str(cert), key=str(key))


def test_body_claiming_another_node_is_recorded_under_the_cert_cn(
    tmp_path: Path, cluster: dict[str, pki.KeyPair], agent_api: AgentAPIServer
) -> None:
    """Renaming node_id in agent.yaml does not let a node speak for another."""
    tls = node_tls(tmp_path, cluster["ca"], "node-a", "node-a")
    client = AgentClient(f"https://127.0.0.1:{agent_api.port}", tls)
    answer = client.heartbeat({"node_id": "node-b", "engines": ["llamacpp"]})
    client.close()
    assert answer["node_id"] == "node-a"
    nodes = agent_api.store.nodes()  # type: ignore[attr-defined]
    assert [n["id"] for n in nodes] == ["node-a"]
    assert nodes[0]["inventory"]["claimed_id"] == "node-b"


def test_node_with_a_cert_from_another_ca_is_refused(
    tmp_path: Path, cluster: dict[str, pki.KeyPair], agent_api: AgentAPIServer
) -> None:
    foreign = pki.create_ca("someone else's CA")
    tls = node_tls(tmp_path, foreign, "node-a", "foreign")
    client = AgentClient(f"https://127.0.0.1:{agent_api.port}", tls)
    with pytest.raises(Unreachable, match="did not answer"):
        client.heartbeat({"node_id": "node-a"})
    client.close()
    assert agent_api.store.nodes() == []  # type: ignore[attr-defined]


def test_agent_refuses_a_server_from_another_ca(
    tmp_path: Path, cluster: dict[str, pki.KeyPair], agent_api: AgentAPIServer
) -> None:
    """The node trusts its cluster CA only: a server cert from elsewhere is no control plane."""
    tls = node_tls(tmp_path, cluster["ca"], "node-a", "node-a")
    other = tmp_path / "other"
    other.mkdir()
    pki.create_ca("elsewhere").write(other, "ca")
    client = AgentClient(f"https://127.0.0.1:{agent_api.port}",
                         TLSFiles(ca=str(other / "ca.pem"), cert=tls.cert, key=tls.key))
    with pytest.raises(Unreachable):
        client.heartbeat({})
    client.close()


def test_the_agent_keeps_one_connection_across_beats(
    tmp_path: Path, cluster: dict[str, pki.KeyPair], agent_api: AgentAPIServer
) -> None:
    """A TLS handshake per beat is what capped the node count: beats share a connection,
    and it outlives the heartbeat interval."""
    from llmgw.agent.client import KEEPALIVE_S
    from llmgw.config import AgentConfig

    assert KEEPALIVE_S > AgentConfig().heartbeat_s
    client = AgentClient(f"https://127.0.0.1:{agent_api.port}",
                         node_tls(tmp_path, cluster["ca"], "node-a", "node-a"))
    for _ in range(5):
        client.heartbeat({})
    client.close()
    assert agent_api.accepted() == 1


def test_negative_control_a_client_without_keepalive_connects_per_beat(
    tmp_path: Path, cluster: dict[str, pki.KeyPair], agent_api: AgentAPIServer
) -> None:
    import httpx

    from llmgw.agent.client import client_context
    from llmgw.contract import AgentPaths

    tls = node_tls(tmp_path, cluster["ca"], "node-a", "node-a")
    with httpx.Client(verify=client_context(tls),
                      limits=httpx.Limits(max_keepalive_connections=0)) as http:
        for _ in range(3):
            http.post(f"https://127.0.0.1:{agent_api.port}{AgentPaths.HEARTBEAT}", json={})
    assert agent_api.accepted() == 3


def test_the_listen_backlog_holds_a_fleet_connecting_at_once(agent_api: AgentAPIServer) -> None:
    """The old server's backlog was 5: connect timeouts at 2,000 nodes."""
    import shutil
    import subprocess

    if not shutil.which("ss"):
        pytest.skip("no ss here (iproute2)")
    out = subprocess.run(["ss", "-ltnH", f"sport = :{agent_api.port}"], capture_output=True,
                         text=True, check=True).stdout.split()
    # State, Recv-Q, Send-Q (the backlog of a listening socket), ...
    assert int(out[2]) >= 2048, out


def _server(tmp_path: Path, store: Store) -> AgentAPIServer:
    ctx = mtls_context(str(tmp_path / "ca.pem"), str(tmp_path / "server.pem"),
                       str(tmp_path / "server-key.pem"))
    server = AgentAPIServer("127.0.0.1", 0, ctx, AgentAPI(store))
    server.start()
    return server


def test_a_connection_that_waited_too_long_for_its_turn_is_closed_unanswered(
    tmp_path: Path, cluster: dict[str, pki.KeyPair], monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a restart the whole fleet reconnects: a handshake that waited past
    HANDSHAKE_QUEUE_S is not done (its agent is about to give up), it is refused at once."""
    from llmgw.control import _tlsserver

    monkeypatch.setattr(_tlsserver, "HANDSHAKE_QUEUE_S", -1.0)  # every wait is too long
    store = Store(tmp_path / "control.db")
    server = _server(tmp_path, store)
    client = AgentClient(f"https://127.0.0.1:{server.port}",
                         node_tls(tmp_path, cluster["ca"], "node-a", "node-a"))
    try:
        with pytest.raises(Unreachable, match="did not answer"):
            client.heartbeat({})
        assert server._server.shed >= 1 and store.nodes() == []
        monkeypatch.setattr(_tlsserver, "HANDSHAKE_QUEUE_S", 5.0)  # negative control
        assert client.heartbeat({})["node_id"] == "node-a"
    finally:
        client.close()
        server.stop()
        store.close()


def test_handshakes_wait_for_a_turn(
    tmp_path: Path, cluster: dict[str, pki.KeyPair], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With one turn, a client whose whole ClientHello came and which then stalls holds
    it until its handshake times out; the next node's handshake waits for it, then is
    served. (A silent connection takes no turn: tests/control/test_tlsserver.py.)"""
    import socket
    import threading

    from llmgw.control import _tlsserver
    from tests.control.test_tlsserver import client_hello

    monkeypatch.setattr(_tlsserver, "HANDSHAKES_AT_ONCE", 1)
    monkeypatch.setattr(_tlsserver, "HANDSHAKE_TIMEOUT_S", 1.5)
    store = Store(tmp_path / "control.db")
    server = _server(tmp_path, store)
    client = AgentClient(f"https://127.0.0.1:{server.port}",
                         node_tls(tmp_path, cluster["ca"], "node-a", "node-a"))
    silent = socket.create_connection(("127.0.0.1", server.port))
    silent.sendall(client_hello())
    answers: list[dict] = []
    try:
        time.sleep(0.2)  # the stalled handshake takes the turn first
        beat = threading.Thread(target=lambda: answers.append(client.heartbeat({})))
        beat.start()
        beat.join(timeout=0.7)
        assert answers == [], "the handshake did not wait for the turn the silent one held"
        beat.join(timeout=10)
        assert answers and answers[0]["node_id"] == "node-a"
    finally:
        silent.close()
        client.close()
        server.stop()
        store.close()


def test_the_agent_api_makes_no_session_tickets(
    tmp_path: Path, cluster: dict[str, pki.KeyPair], agent_api: AgentAPIServer
) -> None:
    """No agent resumes a session, and two tickets per handshake were a quarter of the
    server's CPU per reconnect. The control: a context with the default makes them."""
    tls = node_tls(tmp_path, cluster["ca"], "node-t", "node-t")

    def ticket_after_an_exchange(port: int) -> bool:
        ctx = ssl.create_default_context(cafile=tls.ca)
        ctx.load_cert_chain(tls.cert, tls.key)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
                ctx.wrap_socket(raw, server_hostname="127.0.0.1") as conn:
            conn.sendall(b"GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            while conn.recv(4096):  # tickets come after the handshake, before the answer
                pass
            return conn.session is not None and conn.session.has_ticket

    assert not ticket_after_an_exchange(agent_api.port)
    with_tickets = mtls_context(tls.ca, str(tmp_path / "server.pem"),
                                str(tmp_path / "server-key.pem"))
    with_tickets.num_tickets = 2
    control = AgentAPIServer("127.0.0.1", 0, with_tickets, AgentAPI(agent_api.store))  # type: ignore[attr-defined]
    control.start()
    try:
        assert ticket_after_an_exchange(control.port)
    finally:
        control.stop()
