"""A fresh machine's first answer through the prebuilt engine: `pytest provision/` with an
empty engine cache installs xllamacpp's wheel (no build) and the gateway answers."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from tests.hosts import ThrowawayHost

pytestmark = pytest.mark.slow


def test_an_empty_cache_gets_the_prebuilt_engine_and_the_starter_answers(
        make_host, tiny_gguf, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No cached build and no cmake needed: --engine-prebuilt auto (the default) installs the
    wheel into the new cache; a build would take minutes and name the llamacpp cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty-cache"))
    host: ThrowawayHost = make_host()
    run = host.provision(f"--starter-source={tiny_gguf[0].as_uri()}", timeout=600)
    if run.returncode != 0 and "wheel failed" in run.output:
        pytest.skip("the xllamacpp wheel is not installable here")
    assert run.returncode == 0, run.output[-4000:]
    record = json.loads((host.state_dir / "lib" / "llmgw-agent" / "engine.json").read_text())
    assert record["origin"] == "prebuilt installed", record
    assert record["path"].startswith(str(tmp_path / "empty-cache" / "llmgw" / "engines"
                                         / "xllamacpp"))
    assert not (tmp_path / "empty-cache" / "llmgw" / "engines" / "llamacpp").exists()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{host.ports['gateway']}/v1",
                           api_key=host.gateway_key, max_retries=0)
    chat = client.chat.completions.create(
        model="qwen-0.5b", messages=[{"role": "user", "content": "Say hi"}], max_tokens=8)
    assert chat.usage is not None and chat.usage.completion_tokens > 0
    checks = host.checks()
    assert checks.returncode == 0, checks.output[-4000:]
