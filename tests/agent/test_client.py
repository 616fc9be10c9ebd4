"""The agent API client is a JSONClient: its errors are APIErrors, and a wait that polls it
(host.waiting.through_api_errors) outlasts a control plane that is away, not a refusal."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from llmgw.agent.client import AgentAPIError, AgentClient, NodeRemoved
from llmgw.config import TLSFiles
from llmgw.errors import APIError, Unreachable
from llmgw.host.waiting import Probe, through_api_errors
from llmgw.httpclient import JSONClient

SERVER = "https://cp.example:7443"


def _client(tmp_path: Path, answer: httpx.Response | Exception) -> AgentClient:
    def handle(request: httpx.Request) -> httpx.Response:
        if isinstance(answer, Exception):
            raise answer
        return answer

    tls = TLSFiles(ca=str(tmp_path / "ca.pem"), cert=str(tmp_path / "node.pem"),
                   key=str(tmp_path / "node.key"))
    return AgentClient(SERVER, tls, timeout=2.0, transport=httpx.MockTransport(handle))


def _look(client: AgentClient) -> Probe:
    """One look of a wait on the control plane: ok once it answers a heartbeat."""
    return Probe(True, str(client.heartbeat({})))


def test_the_agent_client_is_a_json_client_and_its_errors_api_errors() -> None:
    assert issubclass(AgentClient, JSONClient)
    assert issubclass(AgentAPIError, APIError) and issubclass(NodeRemoved, AgentAPIError)


def test_no_answer_is_unreachable_and_a_wait_goes_on(tmp_path: Path) -> None:
    """A refused connection: Unreachable (status None), said as the agent always said it."""
    client = _client(tmp_path, httpx.ConnectError("connection refused"))
    with pytest.raises(Unreachable) as e:
        client.heartbeat({})
    assert str(e.value) == f"the control plane at {SERVER} did not answer: connection refused"
    assert e.value.status is None and e.value.transient
    seen = through_api_errors(lambda: _look(client))()
    assert not seen.ok and seen.seen.endswith("connection refused (will ask again)")


def test_a_503_is_unreachable_and_a_wait_goes_on(tmp_path: Path) -> None:
    client = _client(tmp_path, httpx.Response(503, json={"detail": "the store is away"}))
    with pytest.raises(Unreachable, match=r"cannot serve now \(503\)") as e:
        client.heartbeat({})
    assert e.value.status == 503 and e.value.transient
    assert not through_api_errors(lambda: _look(client))().ok


def test_negative_control_a_refusal_ends_the_wait(tmp_path: Path) -> None:
    """A 422 is the control plane's answer, not its absence: the wait stops on it."""
    client = _client(tmp_path, httpx.Response(422, text="bad inventory"))
    with pytest.raises(AgentAPIError, match="answered 422: bad inventory") as e:
        client.heartbeat({})
    assert not isinstance(e.value, Unreachable) and not e.value.transient
    with pytest.raises(AgentAPIError, match="422"):
        through_api_errors(lambda: _look(client))()


def test_negative_control_a_removed_node_ends_the_wait(tmp_path: Path) -> None:
    """The handshake refused the certificate as revoked: no HTTP status, yet asking again
    meets the same revocation list, so it is not transient."""
    client = _client(tmp_path, httpx.ConnectError("[SSL: SSLV3_ALERT_CERTIFICATE_REVOKED]"))
    with pytest.raises(NodeRemoved) as e:
        client.heartbeat({})
    assert e.value.status is None and not e.value.transient
    with pytest.raises(NodeRemoved):
        through_api_errors(lambda: _look(client))()


def test_a_node_not_yet_known_is_none_and_a_known_one_its_record(tmp_path: Path) -> None:
    assert _client(tmp_path, httpx.Response(404, text="no such node")).node() is None
    assert _client(tmp_path, httpx.Response(200, json={"id": "n1"})).node() == {"id": "n1"}
