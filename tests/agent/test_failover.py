"""An agent and several control planes: it learns their URLs from heartbeat answers, keeps
them across a restart, and moves to the next when its own stops answering in time."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import ssl
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from llmgw.agent.agent import Agent
from llmgw.agent.client import AgentClient, NodeRemoved
from llmgw.agent.control_planes import FILE, ControlPlanes, current_server, rendezvous
from llmgw.agent.engines.common import engine_status
from llmgw.agent.engines.cpu import LlamaCpp
from llmgw.agent.gpus import Discovery
from llmgw.config import AgentConfig, EngineConfig, TLSFiles
from llmgw.contract import CPU_ENGINE, AgentPaths, EngineState, NodeState
from llmgw.control.agent_api import AgentAPI, AgentAPIServer, mtls_context
from llmgw.control.nodes import node_view
from llmgw.errors import Unreachable
from llmgw.host import pki
from llmgw.store import Store
from tests.postgres import PostgresServer

# Short enough for a test; the node timeout below is three of them, so that a node left
# unheard for longer than one move takes turns not_ready (the real ones: 5 s and 30 s).
FAILOVER_S = 0.5
NODE_TIMEOUT_S = 3 * FAILOVER_S


@dataclass
class Fleet:
    """Two real agent APIs, each with its own Store on one SQLite file, and what an agent
    of node-a needs to reach them. planes is what both answer in control_planes."""

    tmp: Path
    tls: TLSFiles
    servers: list[AgentAPIServer]
    stores: list[Store]
    planes: list[str] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)
    frozen: list[socket.socket] = field(default_factory=list)

    def url(self, i: int) -> str:
        return self.urls[i]

    def agent(self, server: str, state_dir: Path | None = None) -> Agent:
        config = AgentConfig(server=server, node_id="node-a", tls=self.tls,
                             state_dir=str(state_dir or self.tmp / "agent"),
                             heartbeat_s=0.1, failover_timeout_s=FAILOVER_S,
                             engine=EngineConfig(cache_dir=str(self.tmp / "cache")))
        agent = Agent(config, engine=LlamaCpp(config.engine), discover=lambda: Discovery())
        agent.engine._status = engine_status(CPU_ENGINE, "v", EngineState.READY)
        return agent

    def freeze(self, i: int) -> None:
        """Stop control plane i and put, on its port, a TCP listener that never accepts:
        the kernel completes each TCP handshake into its backlog and nobody ever reads,
        exactly what a SIGSTOPped control plane's socket does (a thread cannot be
        stopped alone)."""
        port = int(self.urls[i].rsplit(":", 1)[1])
        self.servers[i].stop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(16)
        self.frozen.append(sock)

    def state(self) -> str:
        """node-a's state as every control plane sees it (one store), node timeout
        NODE_TIMEOUT_S."""
        store = self.stores[-1]
        return node_view(store.node("node-a"), store.clock(), NODE_TIMEOUT_S)["state"]


@contextlib.contextmanager
def serving(tmp_path: Path, stores: list[Store]) -> Iterator[Fleet]:
    """A control plane's agent API on each of stores (loopback, certificates made here),
    every one answering control_planes with Fleet.planes (set once their ports are known)."""
    ca = pki.create_ca()
    ca.write(tmp_path, "ca")
    pki.issue_server(ca, ["127.0.0.1"]).write(tmp_path, "server")
    cert, key = pki.issue_client(ca, "node-a").write(tmp_path, "agent")
    tls = TLSFiles(ca=str(tmp_path / "ca.pem"), cert=str(cert), key=str(key))
    ctx = (str(tmp_path / "ca.pem"), str(tmp_path / "server.pem"),
           str(tmp_path / "server-key.pem"))
    made = Fleet(tmp_path, tls, [], stores)
    for store in stores:
        api = AgentAPI(store, control_planes=lambda: list(made.planes))
        server = AgentAPIServer("127.0.0.1", 0, mtls_context(*ctx), api)
        server.start()
        made.servers.append(server)
    made.urls = [f"https://127.0.0.1:{s.port}" for s in made.servers]
    made.planes = list(made.urls)
    try:
        yield made
    finally:
        for server in made.servers:
            server.stop()
        for sock in made.frozen:
            sock.close()
        for store in stores:
            store.close()


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    """Function: two control planes on one store (a SQLite file)."""
    with serving(tmp_path, [Store(tmp_path / "control.db"), Store(tmp_path / "control.db")]) \
            as made:
        yield made


def _moves(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.getMessage().startswith("moving from the control plane")]


def test_a_frozen_control_plane_is_left_within_the_timeout_and_the_node_stays_ready(
        fleet: Fleet, caplog: pytest.LogCaptureFixture) -> None:
    agent = fleet.agent(fleet.url(0))
    agent.beat()
    assert agent.control_planes.urls == [fleet.url(0), fleet.url(1)], "learned from the answer"
    fleet.freeze(0)
    caplog.set_level(logging.INFO, logger="llmgw.agent")
    started = time.monotonic()
    agent.beat()
    took = time.monotonic() - started
    assert agent.failures == 0 and agent.client.server == fleet.url(1)
    assert took < FAILOVER_S * 2 + 1.0, f"moving took {took:.1f}s"
    assert fleet.state() == NodeState.READY, "the other control plane heard the node in time"
    [line] = _moves(caplog)
    assert fleet.url(0) in line and fleet.url(1) in line and "did not answer within" in line
    for _ in range(3):  # it stays with the one that answers
        agent.beat()
    assert agent.client.server == fleet.url(1) and len(_moves(caplog)) == 1
    assert fleet.state() == NodeState.READY
    assert current_server(fleet.url(0), fleet.tmp / "agent") == fleet.url(1), (
        "the agent's other processes (llmgw check --serve) send where it moved")
    agent.client.close()


def test_negative_control_with_one_control_plane_the_agent_keeps_failing(
        fleet: Fleet, caplog: pytest.LogCaptureFixture) -> None:
    """Failover off: the control planes name none but themselves... here none at all, so
    the agent knows agent.yaml's server alone, and a frozen one leaves the node unheard."""
    fleet.planes = []
    agent = fleet.agent(fleet.url(0))
    agent.beat()
    assert agent.control_planes.urls == [fleet.url(0)]
    fleet.freeze(0)
    caplog.set_level(logging.INFO, logger="llmgw.agent")
    started = time.monotonic()
    while time.monotonic() - started < NODE_TIMEOUT_S + FAILOVER_S:
        agent.beat()
    assert agent.failures >= 2 and agent.client.server == fleet.url(0)
    assert _moves(caplog) == []
    assert fleet.state() == NodeState.NOT_READY, "unheard past the node timeout"
    agent.client.close()


def test_a_refused_control_plane_is_left_at_once(
        fleet: Fleet, caplog: pytest.LogCaptureFixture) -> None:
    agent = fleet.agent(fleet.url(0))
    agent.beat()
    fleet.servers[0].stop()  # nothing listens on its port now: connections are refused
    caplog.set_level(logging.INFO, logger="llmgw.agent")
    started = time.monotonic()
    agent.beat()
    assert time.monotonic() - started < FAILOVER_S, "a refusal is not waited out"
    assert agent.failures == 0 and agent.client.server == fleet.url(1)
    [line] = _moves(caplog)
    assert fleet.url(0) in line and fleet.url(1) in line and "did not answer" in line
    agent.client.close()


def test_a_control_plane_cut_off_from_its_store_answers_503_and_is_left(
        tmp_path: Path, postgres_server: PostgresServer,
        caplog: pytest.LogCaptureFixture) -> None:
    """Its PostgreSQL stopped, a control plane still answers, but each heartbeat 503
    (Retry-After, nothing recorded): the agent moves to one whose store answers. The
    control: while its store answers, the agent stays with it."""
    stores = [Store(postgres_server.create_database()), Store(tmp_path / "control.db")]
    with serving(tmp_path, stores) as fleet:
        agent = fleet.agent(fleet.url(0))
        agent.beat()
        agent.beat()
        assert agent.failures == 0 and agent.client.server == fleet.url(0)
        caplog.set_level(logging.INFO, logger="llmgw.agent")
        postgres_server.stop()
        try:
            node = ssl.create_default_context(cafile=fleet.tls.ca)
            node.load_cert_chain(fleet.tls.cert, fleet.tls.key)
            with httpx.Client(verify=node, timeout=30) as raw:
                answer = raw.post(f"{fleet.url(0)}{AgentPaths.HEARTBEAT}", json={})
            assert answer.status_code == 503, answer.text
            assert answer.headers["retry-after"] == "5"
            assert "cannot be reached" in answer.json()["detail"]
            assert "not recorded" in answer.json()["detail"]
            agent.beat()
            assert agent.failures == 0 and agent.client.server == fleet.url(1)
            [line] = _moves(caplog)
            assert "cannot serve now (503)" in line and "cannot be reached" in line, line
            assert stores[1].node("node-a") is not None, "heard by the one it moved to"
        finally:
            postgres_server.start()
        agent.client.close()


def test_every_control_plane_away_is_one_failure_and_logged_once(
        fleet: Fleet, caplog: pytest.LogCaptureFixture) -> None:
    agent = fleet.agent(fleet.url(0))
    agent.beat()
    fleet.servers[0].stop()
    fleet.servers[1].stop()
    caplog.set_level(logging.INFO, logger="llmgw.agent")
    for _ in range(3):
        agent.beat()
    assert agent.failures == 3
    assert len(_moves(caplog)) == 1, "later rounds move at debug level: " + caplog.text
    assert len([r for r in caplog.records if "retrying with backoff" in r.getMessage()]) == 1
    agent.client.close()


def test_an_answer_without_control_planes_keeps_the_list(tmp_path: Path) -> None:
    planes = ControlPlanes("https://a:7443", tmp_path)
    assert planes.learn({"node_id": "n", "replicas": [],
                         "control_planes": ["https://a:7443", "https://b:7443/"]})
    assert planes.urls == ["https://a:7443", "https://b:7443"]
    assert not planes.learn({"node_id": "n", "replicas": []}), "an older control plane's"
    assert planes.urls == ["https://a:7443", "https://b:7443"]
    # Negative control: an answer that names a list does change it.
    assert planes.learn({"node_id": "n", "replicas": [], "control_planes": ["https://c:7443"]})
    assert planes.urls == ["https://a:7443", "https://c:7443"]


def test_a_learned_list_survives_a_restart(fleet: Fleet) -> None:
    agent = fleet.agent(fleet.url(0))
    agent.beat()
    agent.client.close()
    again = fleet.agent(fleet.url(0))
    assert again.control_planes.urls == [fleet.url(0), fleet.url(1)]
    fleet.freeze(0)
    again.beat()
    assert again.failures == 0 and again.client.server == fleet.url(1), (
        "a restarted agent moves to a control plane it learned before")
    again.client.close()
    # Negative control: an agent with another state dir knows agent.yaml's server alone.
    other = fleet.agent(fleet.url(0), state_dir=fleet.tmp / "other")
    assert other.control_planes.urls == [fleet.url(0)]
    other.client.close()


def test_a_file_that_cannot_be_read_is_ignored_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / FILE).write_text("{not json")
    caplog.set_level(logging.WARNING, logger="llmgw.agent")
    planes = ControlPlanes("https://a:7443", tmp_path)
    assert planes.urls == ["https://a:7443"] and planes.current == "https://a:7443"
    assert any(str(tmp_path / FILE) in r.getMessage() for r in caplog.records), caplog.text
    planes.learn({"control_planes": ["https://b:7443"]})
    assert json.loads((tmp_path / FILE).read_text())["learned"] == ["https://b:7443"], (
        "the next answer writes it again")
    # Negative control: a good file is read without a warning.
    caplog.clear()
    assert ControlPlanes("https://a:7443", tmp_path).urls == ["https://a:7443",
                                                              "https://b:7443"]
    assert caplog.records == []


def test_host_name_verification_uses_the_urls_host(tmp_path: Path) -> None:
    """Every control plane's certificate is from the one cluster CA; each is still checked
    against the host of the URL the agent moved to, not the first one's."""
    ca = pki.create_ca()
    ca.write(tmp_path, "ca")
    pki.issue_server(ca, ["localhost"]).write(tmp_path, "server")
    cert, key = pki.issue_client(ca, "node-a").write(tmp_path, "agent")
    tls = TLSFiles(ca=str(tmp_path / "ca.pem"), cert=str(cert), key=str(key))
    store = Store(tmp_path / "control.db")
    server = AgentAPIServer("127.0.0.1", 0, mtls_context(
        str(tmp_path / "ca.pem"), str(tmp_path / "server.pem"),
        str(tmp_path / "server-key.pem")), AgentAPI(store))
    server.start()
    client = AgentClient(f"https://localhost:{server.port}", tls, timeout=FAILOVER_S)
    try:
        assert client.heartbeat({"node_id": "node-a"})["node_id"] == "node-a"
        client.move_to(f"https://127.0.0.1:{server.port}")  # not a name the cert holds
        with pytest.raises(Unreachable, match="CERTIFICATE_VERIFY_FAILED|match") as e:
            client.heartbeat({"node_id": "node-a"})
        assert not isinstance(e.value, NodeRemoved)
        client.move_to(f"https://localhost:{server.port}/")  # negative control
        assert client.heartbeat({"node_id": "node-a"})["node_id"] == "node-a"
    finally:
        client.close()
        server.stop()
        store.close()


def _spread_agents(fleet: Fleet, nodes: list[str], folder: str) -> list[Agent]:
    """An agent for each of nodes (its own certificate and state dir under folder), every
    one with agent.yaml naming the first control plane, and no return delay: a node moves
    to its home at the beat after it learned the list."""
    ca = pki.load_pair(fleet.tmp, "ca")
    agents = []
    for node in nodes:
        root = fleet.tmp / folder / node
        cert, key = pki.issue_client(ca, node).write(root, "agent")
        config = AgentConfig(server=fleet.url(0), node_id=node, state_dir=str(root / "state"),
                             tls=TLSFiles(ca=fleet.tls.ca, cert=str(cert), key=str(key)),
                             heartbeat_s=0.1, failover_timeout_s=FAILOVER_S,
                             engine=EngineConfig(cache_dir=str(fleet.tmp / "cache")))
        agent = Agent(config, engine=LlamaCpp(config.engine), discover=lambda: Discovery())
        agent.control_planes.return_delay_s = 0.0
        agents.append(agent)
    return agents


def _beats_to(fleet: Fleet, nodes: list[str]) -> dict[str, str]:
    """Which control plane (its id) each node's last heartbeat went to, as the admin API's
    view of the stored node says it (every control plane records itself in the node it
    hears; `llmgw status` and the fleet page show that view)."""
    store = fleet.stores[-1]
    return {n: node_view(store.node(n), store.clock(), NODE_TIMEOUT_S).get("control_plane", "")
            for n in nodes}


def test_nodes_spread_over_two_control_planes_and_keep_their_home_across_a_restart(
        fleet: Fleet) -> None:
    ids = {fleet.url(i): f"cp-{i}" for i in range(2)}
    for i, server in enumerate(fleet.servers):
        server.api.control_plane = f"cp-{i}"
    nodes = [f"node-{i:02d}" for i in range(24)]
    agents = _spread_agents(fleet, nodes, "spread")
    for agent in agents:
        for _ in range(3):  # learns both from the first answer; at its home from the second
            agent.beat()
        agent.client.close()
    homes = {a.config.node_id: a.control_planes.home for a in agents}
    assert homes == {n: rendezvous(n, fleet.urls)[0] for n in nodes}
    beats_to = _beats_to(fleet, nodes)
    assert beats_to == {n: ids[homes[n]] for n in nodes}, "each beats to its home"
    carried = Counter(beats_to.values())
    assert min(carried[cp] for cp in ids.values()) >= len(nodes) // 6, carried

    # Restarted (a new Agent on the same state dir): the first beat goes home at once.
    for again in _spread_agents(fleet, nodes, "spread"):
        assert again.control_planes.home == homes[again.config.node_id]
        assert again.client.server == homes[again.config.node_id]
        again.beat()
        again.client.close()
    assert _beats_to(fleet, nodes) == beats_to

    # Negative control: answers that name no control plane teach nothing; every node stays
    # with agent.yaml's server, and the second carries none.
    fleet.planes = []
    alone = [f"alone-{i:02d}" for i in range(8)]
    for agent in _spread_agents(fleet, alone, "alone"):
        for _ in range(3):
            agent.beat()
        agent.client.close()
    assert Counter(_beats_to(fleet, alone).values()) == {"cp-0": len(alone)}
