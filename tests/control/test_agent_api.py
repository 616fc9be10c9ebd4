"""The agent API: mutual TLS, and a node is the CN of the certificate it proved."""

from __future__ import annotations

import re
import ssl

import httpx
import pytest

from llmgw.contract import AgentPaths
from llmgw.host import pki
from llmgw_harness._tls import anonymous_request


def _client(cp, cert: tuple[str, str]) -> httpx.Client:
    ctx = ssl.create_default_context(cafile=str(cp.pki_dir / "ca.pem"))
    ctx.load_cert_chain(*cert)
    return httpx.Client(verify=ctx, timeout=5)


def _heartbeat(cp, cert: tuple[str, str], body: dict) -> httpx.Response:
    with _client(cp, cert) as client:
        return client.post(f"https://127.0.0.1:{cp.agent_port}{AgentPaths.HEARTBEAT}", json=body)


def test_heartbeat_is_recorded_under_the_certificate_cn(live_control_plane) -> None:
    """The body claims another node; the certificate decides."""
    cp = live_control_plane
    r = _heartbeat(cp, cp.client_cert("node-a"), {"node_id": "node-b", "cpus": 4})
    assert r.status_code == 200 and r.json()["node_id"] == "node-a"
    nodes = cp.admin.get("/api/v1/nodes").json()
    assert [n["id"] for n in nodes] == ["node-a"]
    assert nodes[0]["state"] == "registering" and nodes[0]["cpus"] == 4


def test_client_from_another_ca_is_refused(live_control_plane) -> None:
    cp = live_control_plane
    with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
        _heartbeat(cp, cp.client_cert("intruder", ca=pki.create_ca()), {})
    assert cp.admin.get("/api/v1/nodes").json() == []


def test_client_without_certificate_is_refused(live_control_plane) -> None:
    cp = live_control_plane
    assert anonymous_request("127.0.0.1", cp.agent_port) is None


def test_negative_control_anonymous_probe_sees_an_open_server(tmp_path) -> None:
    """The refusal probe reports an answer when the server does not ask for a certificate."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    ca = pki.create_ca()
    ca.write(tmp_path, "ca")
    pki.issue_server(ca, ["127.0.0.1"]).write(tmp_path, "server")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tmp_path / "server.pem", tmp_path / "server-key.pem")

    class Open(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Open)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        answer = anonymous_request("127.0.0.1", server.server_address[1])
    finally:
        server.shutdown()
    assert answer is not None and answer.startswith(b"HTTP/1.")


def test_node_turns_not_ready_when_silent(live_control_plane) -> None:
    cp = live_control_plane
    _heartbeat(cp, cp.client_cert("node-a"), {"engines": ["llamacpp"]})
    assert cp.admin.get("/api/v1/nodes").json()[0]["state"] == "ready"
    real_clock = cp.store.clock
    cp.store.clock = lambda: real_clock() + 31
    assert cp.admin.get("/api/v1/nodes").json()[0]["state"] == "not_ready"


def test_bad_json_is_400(live_control_plane) -> None:
    cp = live_control_plane
    with _client(cp, cp.client_cert("n")) as c:
        r = c.post(f"https://127.0.0.1:{cp.agent_port}{AgentPaths.HEARTBEAT}", content=b"[1,")
    assert r.status_code == 400 and "JSON" in r.json()["detail"]


@pytest.mark.parametrize("body, key", [
    ({"cpus": "lots"}, "cpus"),
    ({"gpus": [{"index": "zero"}]}, "gpus.0.index"),
    ({"labels": {"zone": 3}}, "labels.zone"),
    ({"replica_logs": {"r1": "not a list"}}, "replica_logs.r1"),
])
def test_a_heartbeat_with_a_wrong_type_is_422_naming_the_key_and_nothing_is_stored(
    live_control_plane, body, key
) -> None:
    """A heartbeat is untrusted input: refused whole, never a 500 or a stored bad record."""
    cp = live_control_plane
    r = _heartbeat(cp, cp.client_cert("node-a"), body)
    assert r.status_code == 422, r.text
    assert re.search(rf"{re.escape(key)} is .*: Input should be a valid", r.json()["detail"]), \
        r.text
    assert cp.admin.get("/api/v1/nodes").json() == []
    # Negative control: the same node with valid values is recorded.
    assert _heartbeat(cp, cp.client_cert("node-a"), {"cpus": 4}).status_code == 200
    assert [n["id"] for n in cp.admin.get("/api/v1/nodes").json()] == ["node-a"]


def test_a_nodes_drift_is_kept_under_its_certificate_and_shown_by_the_admin_api(
        live_control_plane, tmp_path) -> None:
    """A joined node's `llmgw check --serve` reports through the agent API: the round is
    kept under the certificate's CN (the body names no host), the admin API lists it beside
    the others; a body that is no report is 422, a client without a certificate 401."""
    from llmgw.agent.client import AgentAPIError, AgentClient
    from llmgw.config import TLSFiles

    cp = live_control_plane
    cert, key = cp.client_cert("node-b")
    client = AgentClient(f"https://127.0.0.1:{cp.agent_port}",
                         TLSFiles(ca=str(cp.pki_dir / "ca.pem"), cert=cert, key=key))
    failing = [{"promise": "node/ready", "since": 5.0, "message": "not ready"}]
    try:
        kept = client.report_drift({"checked": 9.0, "promises": 12, "failing": failing})
        assert kept["host"] == "node-b"
        with pytest.raises(AgentAPIError, match="422"):
            client.report_drift({"checked": "soon"})  # type: ignore[typeddict-item]
    finally:
        client.close()
    listed = cp.admin.get("/api/v1/drift").json()
    assert [(d["host"], d["promises"], d["failing"]) for d in listed] == [
        ("node-b", 12, failing)]
    with httpx.Client(verify=ssl.create_default_context(cafile=str(cp.pki_dir / "ca.pem")),
                      timeout=5) as anonymous:
        r = anonymous.put(f"https://127.0.0.1:{cp.agent_port}{AgentPaths.DRIFT}", json={})
    assert r.status_code == 401


@pytest.mark.parametrize("report, said", [
    ({"id": "r1", "state": "paused"}, "replicas.0.state is 'paused'"),
    ({"id": "r1", "state": "stopped"}, "replicas.0.state is 'stopped'"),
    ({"state": "ready"}, "replicas.0.id"),
    ({"id": "r1", "state": "ready", "endpoint": 8080}, "replicas.0.endpoint is 8080"),
])
def test_a_replica_report_the_agent_may_not_make_is_422_naming_it_not_dropped(
    live_control_plane, report, said
) -> None:
    """A state a node may not report (pending and stopped are the scheduler's), or a report
    of the wrong shape, refuses the heartbeat naming it: it is never silently dropped."""
    cp = live_control_plane
    r = _heartbeat(cp, cp.client_cert("node-a"), {"cpus": 4, "replicas": [report]})
    assert r.status_code == 422, r.text
    assert said in r.json()["detail"], r.text
    # Negative control: a report it may make is taken.
    ok = {"id": "r1", "state": "downloading"}
    assert _heartbeat(cp, cp.client_cert("node-a"), {"cpus": 4, "replicas": [ok]}).status_code \
        == 200


def test_the_heartbeat_answer_names_every_live_control_plane(live_control_plane) -> None:
    """control_planes is asked at each heartbeat: a control plane that joins or leaves the
    fleet is in, or out of, the next answer."""
    cp = live_control_plane
    planes = [cp.url, "https://cp-2.example:7443"]
    cp.server.api.control_planes = lambda: list(planes)
    r = _heartbeat(cp, cp.client_cert("node-a"), {})
    assert r.status_code == 200 and r.json()["control_planes"] == planes
    planes.pop()
    assert _heartbeat(cp, cp.client_cert("node-a"), {}).json()["control_planes"] == [cp.url]


def test_without_a_list_the_answer_names_this_control_plane_alone(tmp_path) -> None:
    from llmgw.control.agent_api import AgentAPI
    from llmgw.store import Store

    store = Store(tmp_path / "db")
    try:
        alone = AgentAPI(store, agent_url="https://cp.example:7443").heartbeat("n1", {})
        # Negative control: knowing no URL of its own, it names none, and agents keep theirs.
        unnamed = AgentAPI(store).heartbeat("n1", {})
    finally:
        store.close()
    assert alone["control_planes"] == ["https://cp.example:7443"]
    assert "control_planes" not in unnamed
