"""The gateway as its own service on a provisioned host: it answers while the control plane
is down, a changed server.yaml is found by `pytest checks/` and handed to a new worker by
`pytest provision/` (SIGHUP, no restart), and `llmgw down` stops it."""

from __future__ import annotations

import httpx
import pytest
import yaml

from llmgw.host.services._supervisor import Supervisor
from tests.hosts import ThrowawayHost
from tests.procs import processes

pytestmark = pytest.mark.slow

ASK = {"model": "qwen-0.5b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def host(tmp_path_factory, tiny_gguf):
    h = ThrowawayHost(tmp_path_factory.mktemp("gateway") / "state")
    first = h.provision(f"--starter-source={tiny_gguf[0].as_uri()}")
    assert first.returncode == 0, first.output[-4000:]
    yield h
    h.down()


def ask(host: ThrowawayHost, token: str | None = None) -> httpx.Response:
    """A chat completion with token ('' for none), by default the owner's key."""
    token = host.gateway_key if token is None else token
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.post(f"http://127.0.0.1:{host.ports['gateway']}/v1/chat/completions",
                      json=ASK, headers=headers, timeout=30)


def gateway_pids(host: ThrowawayHost) -> list[int]:
    """`llmgw gateway` processes (master and workers) of this host."""
    return [pid for pid, argv in processes()
            if b"gateway" in argv and str(host.state_dir).encode() in b" ".join(argv)]


def test_the_gateway_answers_from_its_last_table_while_the_control_plane_is_down(host) -> None:
    supervisor = Supervisor(host.state_dir)
    supervisor._rpc().stopProcess("llmgw-server")
    try:
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{host.admin_url}/healthz", timeout=2)
        assert ask(host).status_code == 200
    finally:
        supervisor._rpc().startProcess("llmgw-server")


def test_a_changed_server_yaml_is_found_then_handed_to_a_new_worker(host) -> None:
    server_yaml = host.state_dir / "etc" / "server.yaml"
    data = yaml.safe_load(server_yaml.read_text())
    master = Supervisor(host.state_dir).pid("llmgw-gateway")
    server_yaml.write_text(yaml.safe_dump({**data, "tokens": ["sk-flow"]}))
    try:
        checks = host.checks("-rf")
        assert checks.returncode != 0
        assert any("gateway/config-current" in line or "config-current" in line
                   for line in checks.failed()), checks.output[-3000:]
        again = host.provision()
        assert again.returncode == 0, again.output[-4000:]
        assert any("handed over to a worker" in line for line in again.lines("done")), \
            again.lines("done")
        assert Supervisor(host.state_dir).pid("llmgw-gateway") == master, "not restarted"
        assert ask(host, "").status_code == 401
        assert ask(host, "sk-flow").status_code == 200
        assert host.checks().returncode == 0
    finally:
        server_yaml.write_text(yaml.safe_dump(data))
        host.provision()
    assert ask(host).status_code == 200


def test_down_stops_the_gateway_and_its_workers(host) -> None:
    assert len(gateway_pids(host)) >= 2, "a master and its worker"
    said = host.down()
    assert "stopped supervisord" in said, said
    assert gateway_pids(host) == []
