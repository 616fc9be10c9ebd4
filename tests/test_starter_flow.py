"""The first answer, end to end: `pytest provision/ --gateway-tls` with a tiny GGUF as the
starter's source brings up mirror, node, engine and replica; the gateway answers real
clients over HTTPS, with the owner's key and the keys `llmgw keys` makes."""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from llmgw.agent.replicas.process import pid_is_engine
from tests.hosts import ThrowawayHost
from tests.procs import processes

pytestmark = pytest.mark.slow

# The tiny GGUF's general.name: a file starter is served under its own name; the alias stays.
NAME, ALIAS = "llmgw-tiny-test", "qwen-0.5b"


def until(what: str, predicate, timeout_s: float = 120.0, interval_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f}s waiting for {what}"
        time.sleep(interval_s)


# Provisioned with the hub's variables set (a dead hub: the starter is a file); every later
# run goes without them, as from another shell.
HUB_ENV = {"HF_TOKEN": "hf_flowtestsecret", "HF_ENDPOINT": "http://127.0.0.1:9"}
NO_HUB_ENV = {"HF_TOKEN": "", "HF_ENDPOINT": ""}


@pytest.fixture(scope="module")
def host(tmp_path_factory, tiny_gguf):
    h = ThrowawayHost(tmp_path_factory.mktemp("starter") / "state")
    h.first_run = h.provision(f"--starter-source={tiny_gguf[0].as_uri()}", "--gateway-tls",
                              env=HUB_ENV)
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
    # Two words: the prebuilt engine is `python .../llama-server`.
    return [pid for pid, argv in processes() if any(w.endswith(b"llama-server") for w in argv[:2])]


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")


def gateway(host: ThrowawayHost) -> str:
    return f"https://127.0.0.1:{host.ports['gateway']}"


def trusting(host: ThrowawayHost) -> ssl.SSLContext:
    """Verifies the gateway's certificate with the host's cluster CA."""
    return ssl.create_default_context(cafile=host.ca_cert)


def ask(host: ThrowawayHost, key: str | None = None, **body: object) -> httpx.Response:
    """A chat completion through the gateway with key (the owner's by default)."""
    body = {"model": ALIAS, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            **body}
    return httpx.post(f"{gateway(host)}/v1/chat/completions", json=body, timeout=30,
                      verify=trusting(host),
                      headers={"Authorization": f"Bearer {key or host.gateway_key}"})


def openai_client(host: ThrowawayHost, key: str | None = None) -> openai.OpenAI:
    """The official client as the README shows it: the cluster CA bundle, a key."""
    return openai.OpenAI(base_url=f"{gateway(host)}/v1", api_key=key or host.gateway_key,
                         max_retries=0, http_client=httpx.Client(verify=trusting(host)))


def llmgw(host: ThrowawayHost, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmgw", *args, "--mode=local",
                           f"--state-dir={host.state_dir}"], capture_output=True, text=True,
                          timeout=60)


def test_provision_brings_up_the_first_answer(host) -> None:
    first = host.first_run
    assert first.returncode == 0, first.output[-4000:]
    done = " ".join(first.lines("done"))
    assert f"{NAME} in the mirror" in done and f"{NAME} in the catalog" in done
    assert "it answered" in first.output
    with host.admin() as admin:
        assert [(m["name"], m["aliases"]) for m in admin.models()] == [(NAME, [ALIAS])]


def test_the_hub_token_reaches_the_mirror_through_its_0600_file_only(host) -> None:
    """Local mode: HF_TOKEN is in STATE/etc/mirror.env (0600) and the mirror's environment,
    never in supervisord's program text."""
    env_file = host.state_dir / "etc" / "mirror.env"
    assert env_file.stat().st_mode & 0o777 == 0o600
    assert HUB_ENV["HF_TOKEN"] in env_file.read_text()
    program = (host.state_dir / "supervisor.d" / "llmgw-mirror.conf").read_text()
    assert HUB_ENV["HF_TOKEN"] not in program and "--env-file" in program
    [pid] = [pid for pid, argv in processes() if b"mirror\0serve" in b"\0".join(argv)
             and str(host.state_dir).encode() in b"\0".join(argv)]
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert f"HF_TOKEN={HUB_ENV['HF_TOKEN']}".encode() in environ


def test_checks_pass_then_a_second_provision_keeps_everything(host) -> None:
    """From a shell without the hub's variables: checks pass, provision keeps everything
    (the token stays in mirror.env, the mirror is not restarted)."""
    checks = host.checks(env=NO_HUB_ENV)
    assert checks.returncode == 0, checks.output[-4000:]
    for step in ("pki", "control_plane", "gateway", "mirror", "node", "starter"):
        assert not checks.skips(step), checks.output[-4000:]
    again = host.provision(env=NO_HUB_ENV)
    assert again.returncode == 0, again.output[-4000:]
    assert "done" not in again.statuses(), again.lines("done")


def test_the_openai_client_gets_a_completion_and_a_stream(host) -> None:
    client = openai_client(host)
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
    client = openai_client(host)
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
        until("the gateway to know pinned-nowhere",
              lambda: ask(host, model="pinned-nowhere").status_code != 404, 5)
        with pytest.raises(openai.InternalServerError) as err:
            client.chat.completions.create(model="pinned-nowhere",
                                           messages=[{"role": "user", "content": "x"}])
        # At once, with the scheduler's reason (not after the load wait).
        assert err.value.status_code == 503 and "cannot be placed" in str(err.value)
        assert "zone=mars" in str(err.value)
    finally:
        httpx.delete(f"{host.admin_url}/api/v1/models/pinned-nowhere", headers=host.auth)


def test_a_fresh_host_needs_a_key_and_the_owners_key_answers(host) -> None:
    key_file = host.state_dir / "etc" / "gateway-key"
    assert key_file.stat().st_mode & 0o777 == 0o600
    with pytest.raises(openai.AuthenticationError) as refused:
        openai_client(host, "unused").chat.completions.create(
            model=ALIAS, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert refused.value.status_code == 401
    answer = openai_client(host).chat.completions.create(
        model=ALIAS, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert answer.choices[0].message.content is not None
    anonymous = httpx.get(f"{gateway(host)}/v1/models", verify=trusting(host), timeout=10)
    assert anonymous.status_code == 401


def test_the_gateway_serves_https_the_ca_bundle_verifies_and_nothing_else_does(host) -> None:
    plain = openai.OpenAI(base_url=f"{gateway(host)}/v1", api_key=host.gateway_key,
                          max_retries=0)
    with pytest.raises(openai.APIConnectionError) as err:
        plain.models.list()  # the system's roots do not know the cluster CA
    assert "CERTIFICATE_VERIFY_FAILED" in repr(err.value.__cause__)
    assert ALIAS in [m.id for m in openai_client(host).models.list()]


def test_a_key_for_one_model_at_60_rpm_gets_404_for_another_and_429_past_its_rate(
        host) -> None:
    made = llmgw(host, "keys", "create", "--name", "narrow", "--models", ALIAS, "--rpm", "60")
    assert made.returncode == 0, made.stderr
    narrow = made.stdout.splitlines()[0]
    model = {"name": "other-model", "source": "http://127.0.0.1:9/x.gguf",
             "profiles": [{"name": "cpu", "engine": "llamacpp",
                           "node_selector": {"zone": "mars"}}]}
    assert httpx.post(f"{host.admin_url}/api/v1/models", json=model,
                      headers=host.auth).status_code == 201
    try:
        until("the gateway to know other-model",
              lambda: ask(host, model="other-model").status_code == 503, 5)
        hidden = ask(host, narrow, model="other-model")
        absent = ask(host, narrow, model="no-such-model")
        assert hidden.status_code == absent.status_code == 404
        assert hidden.json()["error"]["code"] == "model_not_found"
        listed = [m.id for m in openai_client(host, narrow).models.list()]
        assert sorted(listed) == sorted([NAME, ALIAS])
    finally:
        httpx.delete(f"{host.admin_url}/api/v1/models/other-model", headers=host.auth)
    statuses = [ask(host, narrow, max_tokens=1).status_code for _ in range(61)]
    assert statuses[:60] == [200] * 60 and statuses[60] == 429, statuses
    with pytest.raises(openai.RateLimitError) as err:
        openai_client(host, narrow).chat.completions.create(
            model=ALIAS, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert int(err.value.response.headers["retry-after"]) >= 1
    assert ask(host).status_code == 200, "the owner's key has no limit"


def test_keys_ls_and_metrics_show_usage_per_key_and_rm_is_401_within_a_refresh(host) -> None:
    made = llmgw(host, "keys", "create", "--name", "metered")
    assert made.returncode == 0, made.stderr
    metered = made.stdout.splitlines()[0]
    for _ in range(3):
        assert ask(host, metered, max_tokens=2).status_code == 200
    text = httpx.get(f"{host.admin_url}/metrics", headers=host.auth, timeout=10).text
    tokens = [line for line in text.splitlines()
              if line.startswith('llmgw_gateway_tokens_total{key="metered"')]
    assert tokens and all(float(line.rsplit(" ", 1)[1]) > 0 for line in tokens), tokens
    assert f'llmgw_gateway_requests_total{{key="metered",model="{NAME}",status="200"}} 3.0' \
        in text

    def listed() -> str:
        out = llmgw(host, "keys", "ls").stdout
        row = next(line for line in out.splitlines() if line.startswith("metered "))
        return row if " 3 " in row else ""

    row = until("keys ls to show the usage (flushed every 2 s)", listed, 10)
    assert " ago" in row and metered[18:] not in row
    assert llmgw(host, "keys", "rm", "metered").returncode == 0
    time.sleep(0.6)  # the gateway reads the keys every 0.5 s
    assert ask(host, metered).status_code == 401


def test_killed_agent_leaves_the_engine_serving_and_adopts_it(host) -> None:
    pid = engine_pid(host)
    conf = host.state_dir / "supervisord.conf"
    agent = subprocess.run([sys.executable, "-m", "supervisor.supervisorctl", "-c", str(conf),
                            "pid", "llmgw-agent"], capture_output=True, text=True, check=True)
    os.kill(int(agent.stdout.strip()), signal.SIGKILL)
    for _ in range(10):  # served throughout, while supervisord restarts the agent
        assert ask(host, max_tokens=4).status_code == 200
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
    out = result.output.splitlines()
    lines = [line for line in out if "cannot be reached" in line]
    assert lines and "--starter-source" in lines[0] and "--no-starter" in lines[0], result.output
    # Said live, on its own line, before the node's engine wait ends (the summary repeats it).
    said = next(i for i, line in enumerate(out) if line.startswith("FAIL  starter       source:"))
    ready = next(i for i, line in enumerate(out) if "is ready with llamacpp" in line)
    assert said < ready, result.output
