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


def test_one_command_adds_a_gguf_url_and_it_answers_its_first_request(host, served_gguf,
                                                                      tmp_path) -> None:
    """A bad source first (a file that is not GGUF): one line, catalog and mirror as they
    were. Then the tiny GGUF's URL (loopback http): added, and its first chat completion
    through the gateway is 200. (Default min 1: loading a model at min 0 on its first
    request is not on this branch.)"""
    before = held(host)
    bad = tmp_path / "notes.gguf"
    bad.write_text("these are not weights\n")
    refused = llmgw(host, "models", "add", str(bad))
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
    assert "is not a GGUF model file" in refused.stderr
    assert held(host) == before and before[0] == []

    done = llmgw(host, "models", "add", served_gguf[0], "--name", "added",
                 "--alias", "added-chat")
    assert done.returncode == 0, done.stderr
    assert "runs on " in done.stdout and "profile cpu" in done.stdout, done.stdout
    gateway = f"http://127.0.0.1:{host.ports['gateway']}"
    deadline, last = time.monotonic() + 300, ""
    while True:
        try:
            answer = ask(gateway, host.gateway_key, "added-chat", "hi", 30.0)
            break
        except AssertionError as e:  # 503 until its replica is ready
            last = str(e)
        assert time.monotonic() < deadline, f"added-chat never answered; last: {last}"
        time.sleep(1)
    assert answer
    names, mirror = held(host)
    assert names == ["added"]
    assert [v["status"]["sha256"] for v in mirror if v["model"] == "added"] == [served_gguf[1]]
