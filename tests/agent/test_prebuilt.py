"""engine.prebuilt: where xllamacpp's prebuilt wheel comes in the order of sources, and the
real wheel installed by the agent's own provisioning, serving what llama-server serves."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from llmgw.agent.engines import _prebuilt
from llmgw.agent.engines.cpu import LlamaCpp
from llmgw.agent.replicas.process import stop_engines
from llmgw.agent.replicas.supervisor import ReplicaSupervisor
from llmgw.config import EngineConfig
from tests.agent.conftest import FakeBinary


def engine(tmp_path: Path, prebuilt: str) -> LlamaCpp:
    cfg = EngineConfig(cache_dir=str(tmp_path / "cache"), prebuilt=prebuilt)
    return LlamaCpp(cfg, state_dir=tmp_path / "state",
                    search_path=str(tmp_path / "empty"))


def fake_install(cache: Path) -> None:
    """The marker and interpreter an install leaves (the wheel itself is not needed here)."""
    venv = _prebuilt.home(cache) / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    (venv / ".installed").write_text("xllamacpp\n")


def test_off_never_looks_at_the_wheel(tmp_path: Path) -> None:
    e = engine(tmp_path, "off")
    fake_install(e.cache_dir)
    assert e.locate() is None


def test_auto_keeps_a_cached_build_first(tmp_path: Path, fake_llama_server: FakeBinary) -> None:
    e = engine(tmp_path, "auto")
    fake_install(e.cache_dir)
    cached = fake_llama_server(e.cached_binary.parent)
    found = e.locate()
    assert found is not None and (found.path, found.origin) == (cached, "cache")


def test_auto_takes_an_installed_wheel_when_no_build_is_cached(tmp_path: Path) -> None:
    e = engine(tmp_path, "auto")
    fake_install(e.cache_dir)
    found = e.locate()
    assert found is not None and found.origin == "prebuilt cache"
    assert found.path == _prebuilt.launcher(e.cache_dir)
    assert found.version == f"xllamacpp-{_prebuilt.VERSION}"
    first = found.path.read_text().splitlines()[0]
    assert first == f"#!{_prebuilt.home(e.cache_dir) / 'venv' / 'bin' / 'python'}"
    assert os.access(found.path, os.X_OK)


def test_xllamacpp_goes_before_a_cached_build(tmp_path: Path,
                                              fake_llama_server: FakeBinary) -> None:
    e = engine(tmp_path, "xllamacpp")
    fake_install(e.cache_dir)
    fake_llama_server(e.cached_binary.parent)
    found = e.locate()
    assert found is not None and found.origin == "prebuilt cache"


def test_auto_leaves_a_named_version_to_the_source_build(tmp_path: Path) -> None:
    e = LlamaCpp(EngineConfig(cache_dir=str(tmp_path / "cache"), prebuilt="auto",
                              version="0.3.30"), search_path=str(tmp_path / "empty"))
    fake_install(e.cache_dir)
    assert e.locate() is None


def test_a_wheel_pip_cannot_get_fails_xllamacpp_naming_the_log(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    status = engine(tmp_path, "xllamacpp").provision()
    assert status["state"] == "failed", status
    assert "installing the xllamacpp" in status["detail"] and "install.log" in status["detail"]
    assert "engine.prebuilt: off" in status["detail"]


def test_auto_builds_when_the_wheel_cannot_be_had(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The build path takes over: here it finds no cmake, so the node says so."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    status = engine(tmp_path, "auto").provision()
    assert status["state"] == "unsupported" and "cmake" in status["detail"], status


def test_a_launcher_from_another_llmgw_is_rewritten(tmp_path: Path) -> None:
    e = engine(tmp_path, "auto")
    fake_install(e.cache_dir)
    launcher = _prebuilt.write_launcher(e.cache_dir)
    launcher.write_text("#!/bin/sh\nexit 1\n")
    assert "xllamacpp.Server" in _prebuilt.write_launcher(e.cache_dir).read_text()


# --- the real wheel ---


@pytest.fixture(scope="session")
def prebuilt_engine() -> str:
    """Session: the prebuilt engine as a node gets it (engine.prebuilt: xllamacpp; pip
    installs the wheel into ~/.cache/llmgw the first time); skipped where it cannot."""
    e = LlamaCpp(EngineConfig(prebuilt="xllamacpp"))
    status = e.provision()
    if status["state"] != "ready" and "wheel failed" in status["detail"]:
        pytest.skip(f"the xllamacpp wheel is not installable here: {status['detail']}")
    assert status["state"] == "ready", status["detail"]
    assert e.found is not None and e.found.origin.startswith("prebuilt")
    return str(e.found.path)


@pytest.fixture
def prebuilt_supervisor(tmp_path: Path, prebuilt_engine: str) -> Iterator[ReplicaSupervisor]:
    sup = ReplicaSupervisor(state_dir=tmp_path / "agent", weights_dir=tmp_path / "weights",
                            engine=lambda kind: prebuilt_engine, bind_host="127.0.0.1")
    yield sup
    stop_engines(tmp_path / "agent")


def ready_replica(sup: ReplicaSupervisor, url: str, digest: str, args: list[str]) -> dict:
    sup.reconcile([{"id": "r-1", "model": "tiny", "profile": "cpu", "engine": "llamacpp",
                    "gpu_class": "", "source": url, "sha256": digest, "args": args}])
    deadline = time.monotonic() + 60
    while (r := sup.report()[0])["state"] != "ready":
        assert r["state"] != "failed" and time.monotonic() < deadline, r
        time.sleep(0.2)
    return r


slow = pytest.mark.slow


@slow
def test_prebuilt_engine_answers_version_as_the_node_check_reads_it(
        prebuilt_engine: str) -> None:
    out = subprocess.run([prebuilt_engine, "--version"], capture_output=True, text=True,
                         timeout=60, check=True)
    assert f"version: xllamacpp-{_prebuilt.VERSION}" in out.stderr


@slow
def test_prebuilt_engine_refuses_an_unknown_flag_with_2(prebuilt_engine: str) -> None:
    out = subprocess.run([prebuilt_engine, "-m", "x.gguf", "--log-file", "/tmp/x"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2 and "unknown argument '--log-file'" in out.stderr


@slow
def test_prebuilt_engine_serves_chat_streaming_metrics_slots_behind_its_key(
        prebuilt_supervisor: ReplicaSupervisor, served_gguf: tuple[str, str]) -> None:
    # With the flags the control plane adds to a chat replica's (engine_args.SLOT_ARGS):
    # xllamacpp's parameters must have their fields.
    r = ready_replica(prebuilt_supervisor, *served_gguf,
                      ["--ctx-size", "512", "--threads", "1", "--threads-http", "8",
                       "--slot-prompt-similarity", "0", "--no-cache-idle-slots"])
    base, key = r["endpoint"], {"Authorization": f"Bearer {r['api_key']}"}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    assert httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30).status_code == 401
    ok = httpx.post(f"{base}/v1/chat/completions", json=body, headers=key, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] > 0
    with httpx.stream("POST", f"{base}/v1/chat/completions", json={**body, "stream": True},
                      headers=key, timeout=30) as s:
        events = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert s.status_code == 200 and events[-1] == "data: [DONE]"
    done = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 4},
                      headers=key, timeout=30)
    assert done.status_code == 200 and done.json()["choices"][0]["text"]
    assert "llamacpp:prompt_tokens_total" in httpx.get(f"{base}/metrics", headers=key).text
    assert len(httpx.get(f"{base}/slots", headers=key).json()) == 4


@slow
def test_prebuilt_engine_is_adopted_by_a_new_supervisor(
        prebuilt_supervisor: ReplicaSupervisor, served_gguf: tuple[str, str],
        tmp_path: Path, prebuilt_engine: str) -> None:
    """The agent finds its running engine again though it is `python .../llama-server`."""
    before = ready_replica(prebuilt_supervisor, *served_gguf, ["--ctx-size", "512"])
    again = ReplicaSupervisor(state_dir=tmp_path / "agent", weights_dir=tmp_path / "weights",
                              engine=lambda kind: prebuilt_engine, bind_host="127.0.0.1")
    after = again.report()[0]
    assert (after["state"], after["pid"]) == ("ready", before["pid"])


@slow
def test_prebuilt_engine_serves_embeddings_when_asked(
        prebuilt_supervisor: ReplicaSupervisor, served_gguf: tuple[str, str]) -> None:
    r = ready_replica(prebuilt_supervisor, *served_gguf,
                      ["--ctx-size", "512", "--embeddings", "--pooling", "mean"])
    got = httpx.post(f"{r['endpoint']}/v1/embeddings", json={"input": ["hello", "world é"]},
                     headers={"Authorization": f"Bearer {r['api_key']}"}, timeout=30)
    assert got.status_code == 200, got.text
    assert [len(d["embedding"]) for d in got.json()["data"]] == [64, 64]


@slow
def test_the_tiny_models_answers_are_valid_text_on_the_newer_llama_cpp(
        prebuilt_supervisor: ReplicaSupervisor, served_gguf: tuple[str, str]) -> None:
    """With byte tokens, newer llama.cpp sent U+FFFD or 500 for answers cut inside a character."""
    r = ready_replica(prebuilt_supervisor, *served_gguf, ["--ctx-size", "512"])
    key = {"Authorization": f"Bearer {r['api_key']}"}
    with httpx.Client(base_url=r["endpoint"], headers=key, timeout=30) as client:
        for seed in range(20):
            got = client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi é"}], "max_tokens": 24,
                "seed": seed, "temperature": 1.5})
            assert got.status_code == 200, got.text
            assert "\ufffd" not in got.json()["choices"][0]["message"]["content"]


_SUPPORTS = """
import ctypes, pathlib, sys
import xllamacpp
lib = ctypes.CDLL(str(next(pathlib.Path(xllamacpp.__file__).parent.glob("xllamacpp*.so"))))
for name in sys.argv[1:]:
    getattr(lib, name).restype = ctypes.c_bool
    print(name, bool(getattr(lib, name)()))
"""


@slow
def test_the_prebuilt_engine_has_no_rpc_backend(prebuilt_engine: str) -> None:
    """What the docs say of the wheel: its install holds no rpc-server, and its library's
    own llama_supports_rpc() answers false (its `--rpc` is llama.cpp's common parser,
    which then says "RPC not supported in this build"). The control: the same call of
    llama_supports_mmap(), which that library does support, answers true, so a false is
    the library's answer and not the call's."""
    home = Path(prebuilt_engine).parent
    assert not [p for p in home.rglob("*rpc-server*")], "an rpc-server in the wheel's install"
    python = home / "venv" / "bin" / "python"
    out = subprocess.run([str(python), "-c", _SUPPORTS, "llama_supports_rpc",
                          "llama_supports_mmap"], capture_output=True, text=True, timeout=60,
                         check=True).stdout.split()
    assert out == ["llama_supports_rpc", "False", "llama_supports_mmap", "True"], out
