"""The first answer, end to end: `pytest provision/` with a tiny GGUF as the starter's
source brings up mirror, node, engine and replica; the gateway answers real clients."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from llmgw.agent.replicas import pid_is_engine
from tests.hosts import ThrowawayHost

pytestmark = pytest.mark.slow

NAME, ALIAS = "qwen2.5-0.5b-instruct", "qwen-0.5b"


def until(what: str, predicate, timeout_s: float = 120.0, interval_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f}s waiting for {what}"
        time.sleep(interval_s)


@pytest.fixture(scope="module")
def host(tmp_path_factory, tiny_gguf):
    h = ThrowawayHost(tmp_path_factory.mktemp("starter") / "state")
    h.first_run = h.provision(f"--starter-source={tiny_gguf[0].as_uri()}")
    yield h
    h.down()


def replicas(host: ThrowawayHost, model: str = NAME) -> list[dict]:
    r = httpx.get(f"{host.admin_url}/api/v1/replicas", params={"model": model},
                  headers=host.auth, timeout=10)
    return [x for x in r.json() if x["state"] != "stopped"]


def node_state(host: ThrowawayHost) -> str:
    nodes = httpx.get(f"{host.admin_url}/api/v1/nodes", headers=host.auth, timeout=10).json()
    return nodes[0]["state"] if nodes else "none"


def engine_pid(host: ThrowawayHost) -> int:
    import json

    records = list((host.state_dir / "lib" / "llmgw-agent" / "replicas").glob("*.json"))
    assert len(records) == 1, records
    return json.loads(records[0].read_text())["pid"]


def llama_servers() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
            and (p / "cmdline").exists()
            and b"llama-server" in (p / "cmdline").read_bytes().split(b"\0")[0]]


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")


def gateway(host: ThrowawayHost) -> str:
    return f"http://127.0.0.1:{host.ports['gateway']}"


def test_provision_brings_up_the_first_answer(host) -> None:
    first = host.first_run
    assert first.returncode == 0, first.output[-4000:]
    done = " ".join(first.lines("done"))
    assert f"{NAME} in the mirror" in done and f"{NAME} in the catalog" in done
    assert "it answered" in first.output


def test_checks_pass_then_a_second_provision_keeps_everything(host) -> None:
    checks = host.checks()
    assert checks.returncode == 0, checks.output[-4000:]
    for step in ("pki", "control_plane", "gateway", "mirror", "node", "starter"):
        assert not checks.skips(step), checks.output[-4000:]
    again = host.provision()
    assert again.returncode == 0, again.output[-4000:]
    assert "done" not in again.statuses(), again.lines("done")


def test_the_openai_client_gets_a_completion_and_a_stream(host) -> None:
    client = openai.OpenAI(base_url=f"{gateway(host)}/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(
        model=ALIAS, messages=[{"role": "user", "content": "Say hi"}], max_tokens=8)
    assert chat.choices[0].message.content is not None and chat.usage.completion_tokens > 0
    stream = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Say hi"}], max_tokens=8, stream=True)
    chunks = list(stream)
    assert len(chunks) > 1 and any(c.choices and c.choices[0].delta.content for c in chunks)
    assert {c.model for c in chunks} == {NAME}, "the engine's file path never shows"
    assert chat.model == ALIAS
    listed = [m.id for m in client.models.list()]
    assert NAME in listed and ALIAS in listed


def test_unknown_model_404_and_a_model_pinned_nowhere_stays_pending_with_503(host) -> None:
    client = openai.OpenAI(base_url=f"{gateway(host)}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    model = {"name": "pinned-nowhere", "source": "http://127.0.0.1:9/x.gguf",
             "profiles": [{"name": "cpu", "engine": "llamacpp",
                           "node_selector": {"zone": "mars"}}]}
    assert httpx.post(f"{host.admin_url}/api/v1/models", json=model,
                      headers=host.auth).status_code == 201
    try:
        pending = until("a pending replica", lambda: replicas(host, "pinned-nowhere"), 15)
        assert pending[0]["state"] == "pending" and "zone=mars" in pending[0]["err"]
        # The gateway reads the catalog at most every 0.5 s: the scheduler may be quicker.
        ask = {"model": "pinned-nowhere", "messages": [{"role": "user", "content": "x"}]}
        until("the gateway to know pinned-nowhere", lambda: httpx.post(
            f"{gateway(host)}/v1/chat/completions", json=ask, timeout=10).status_code != 404, 5)
        with pytest.raises(openai.InternalServerError) as err:
            client.chat.completions.create(model="pinned-nowhere",
                                           messages=[{"role": "user", "content": "x"}])
        assert err.value.status_code == 503 and "pending" in str(err.value)
    finally:
        httpx.delete(f"{host.admin_url}/api/v1/models/pinned-nowhere", headers=host.auth)


def test_killed_agent_leaves_the_engine_serving_and_adopts_it(host) -> None:
    pid = engine_pid(host)
    conf = host.state_dir / "supervisord.conf"
    agent = subprocess.run([sys.executable, "-m", "supervisor.supervisorctl", "-c", str(conf),
                            "pid", "llmgw-agent"], capture_output=True, text=True, check=True)
    os.kill(int(agent.stdout.strip()), signal.SIGKILL)
    body = {"model": ALIAS, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for _ in range(10):  # served throughout, while supervisord restarts the agent
        assert httpx.post(f"{gateway(host)}/v1/chat/completions", json=body,
                          timeout=30).status_code == 200
        time.sleep(0.3)
    until("the node to be ready again", lambda: node_state(host) == "ready", 60)
    checks = host.checks()
    assert checks.returncode == 0, checks.output[-4000:]
    assert engine_pid(host) == pid, "the same engine, adopted"
    assert pid_is_engine(pid, int(replicas(host)[0]["endpoint"].rsplit(":", 1)[1]))
    mine = [p for p in llama_servers() if str(host.state_dir) in cmdline(p)]
    assert mine == [pid], "no second llama-server for this host"


def test_killed_engine_comes_back_ready_by_itself(host) -> None:
    pid = engine_pid(host)
    os.kill(pid, signal.SIGKILL)
    until("the replica to leave ready", lambda: any(
        r["state"] in ("failed", "starting") for r in replicas(host)), 30, 0.2)
    until("the replica to be ready again", lambda: any(
        r["state"] == "ready" for r in replicas(host)), 120)
    assert engine_pid(host) != pid
    assert host.checks().returncode == 0


def test_down_stops_the_services_and_the_engines(host) -> None:
    assert [p for p in llama_servers() if str(host.state_dir) in cmdline(p)]
    said = host.down()
    assert "stopped supervisord" in said and "stopped engines" in said, said
    assert not [p for p in llama_servers() if str(host.state_dir) in cmdline(p)]
    assert not (host.state_dir / "supervisor.sock").exists() or "not running" in host.down()


def test_a_dead_hub_without_a_source_fails_at_once_naming_the_option(make_host, monkeypatch):
    """No --starter-source and no way to the hub: one line, within seconds, naming the option."""
    from tests.hosts import free_port

    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    host: ThrowawayHost = make_host()
    started = time.monotonic()
    result = host.provision()
    assert result.returncode != 0
    assert time.monotonic() - started < 120
    lines = [line for line in result.output.splitlines() if "cannot be reached" in line]
    assert lines and "--starter-source" in lines[0] and "--no-starter" in lines[0], result.output
