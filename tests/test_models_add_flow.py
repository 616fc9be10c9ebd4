"""Adding a model is one command: on a host `pytest provision/ --no-starter` made (mirror,
control plane, gateway, a node with the real llama.cpp engine, no model), `llmgw models
add URL` puts the file in the mirror and the catalog, and the model answers its first
request through the gateway; a bad source is refused in one line and changes nothing."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest

from llmgw_harness.starter import ask
from tests.hosts import ThrowawayHost

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """Module: a provisioned host with no model in its catalog."""
    h = ThrowawayHost(tmp_path_factory.mktemp("models-add") / "state")
    first = h.provision("--no-starter")
    assert first.returncode == 0, first.output[-4000:]
    yield h
    h.down()


def llmgw(host: ThrowawayHost, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmgw", *args, "--mode=local",
                           f"--state-dir={host.state_dir}"], capture_output=True, text=True,
                          timeout=120)


def held(host: ThrowawayHost) -> tuple[list, list]:
    """The catalog's names and the mirror's model versions."""
    with host.admin() as admin:
        names = [m["name"] for m in admin.models()]
    mirror = httpx.get(f"{host.mirror_api_url}/api/v1/models", headers=host.auth, timeout=10)
    return names, mirror.json()


def wait_listed(gateway: str, key: str, name: str, timeout_s: float = 30.0) -> bool:
    """Until the gateway's /v1/models lists name (its table is read every moment)."""
    deadline, seen = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline:
        got = httpx.get(f"{gateway}/v1/models", headers={"Authorization": f"Bearer {key}"},
                        timeout=10)
        seen = [m["id"] for m in got.json().get("data", [])] if got.status_code == 200 else []
        if name in seen:
            return True
        time.sleep(0.2)
    raise AssertionError(f"the gateway never listed {name} within {timeout_s:.0f}s; "
                         f"last it listed {seen}")


def test_one_command_adds_a_gguf_url_and_it_answers_its_first_request(host, served_gguf,
                                                                      tmp_path) -> None:
    """A bad source first (a file that is not GGUF): one line, catalog and mirror as they
    were. Then the tiny GGUF's URL (loopback http) with --min 0: added, nothing started
    for it, and its very first chat completion through the gateway is 200 (it waits in
    the gateway's load queue while its one replica starts)."""
    before = held(host)
    bad = tmp_path / "notes.gguf"
    bad.write_text("these are not weights\n")
    refused = llmgw(host, "models", "add", str(bad))
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
    assert "is not a GGUF model file" in refused.stderr
    assert held(host) == before and before[0] == []

    done = llmgw(host, "models", "add", served_gguf[0], "--name", "added",
                 "--alias", "added-chat", "--min", "0")
    assert done.returncode == 0, done.stderr
    assert "min 0: no replica starts now; one would run on " in done.stdout, done.stdout
    assert "profile cpu" in done.stdout, done.stdout
    gateway = f"http://127.0.0.1:{host.ports['gateway']}"
    listed = wait_listed(gateway, host.gateway_key, "added-chat")
    with host.admin() as admin:
        assert [r for r in admin.replicas() if r["model"] == "added"] == [], \
            "a model at min 0 got a replica before anyone asked for it"
    assert listed
    answer = ask(gateway, host.gateway_key, "added-chat", "hi", 150.0)
    assert answer
    with host.admin() as admin:
        assert len([r for r in admin.replicas() if r["model"] == "added"]) == 1
    names, mirror = held(host)
    assert names == ["added"]
    assert [v["status"]["sha256"] for v in mirror if v["model"] == "added"] == [served_gguf[1]]
