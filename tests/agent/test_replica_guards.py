"""What the agent (root) refuses before it starts an engine: file:// weights, and profile
args outside the engine flag allow-list, even when the catalog was bypassed."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from llmgw.agent.replicas.process import Record
from llmgw.agent.replicas.supervisor import Replica, ReplicaSupervisor
from llmgw.model.engine_args import EngineArgsError


@pytest.fixture
def marker_engine(tmp_path: Path) -> tuple[Path, Path]:
    """A fake llama-server that leaves a marker file when it is started at all."""
    marker = tmp_path / "engine-started"
    engine = tmp_path / "bin" / "llama-server"
    engine.parent.mkdir()
    engine.write_text(f"#!/bin/sh\ntouch {marker}\nsleep 30\n")
    engine.chmod(0o755)
    return engine, marker


def _failure(sup: ReplicaSupervisor, timeout_s: float = 10.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        (r,) = sup.report()
        if r["state"] == "failed":
            return r["err"]
        time.sleep(0.05)
    raise AssertionError(f"the replica never failed: {sup.report()}")


def _supervisor(tmp_path: Path, engine: Path) -> ReplicaSupervisor:
    return ReplicaSupervisor(state_dir=tmp_path / "agent", weights_dir=tmp_path / "weights",
                             engine=lambda kind: str(engine), bind_host="127.0.0.1")


def _assignment(source: str, args: list[str]) -> dict:
    return {"id": "r-1", "model": "tiny", "profile": "cpu", "source": source, "sha256": "",
            "args": args}


def test_file_sources_are_refused(tmp_path: Path, marker_engine) -> None:
    engine, marker = marker_engine
    secret = tmp_path / "secret.gguf"
    secret.write_text("root's")
    sup = _supervisor(tmp_path, engine)
    sup.reconcile([_assignment(secret.as_uri(), [])])
    assert "only over http(s)" in _failure(sup)
    assert not marker.exists(), "no engine started"


@pytest.mark.parametrize("flag", ["--api-key", "--host", "--log-file", "--model"])
def test_args_outside_the_allow_list_never_reach_the_engine(tmp_path, marker_engine, flag):
    """start_engine checks the args itself: a record that bypassed the catalog (an older
    control plane, a hand-edited database) still starts nothing."""
    engine, marker = marker_engine
    target = tmp_path / "written-by-root"
    record = Record(id="r-1", model="tiny", profile="cpu", source="", sha256="",
                    args=[flag, str(target)], weights=str(tmp_path / "tiny.gguf"))
    sup = _supervisor(tmp_path, engine)
    with pytest.raises(EngineArgsError, match=f"engine flag {flag} is not allowed"):
        sup.start_engine(Replica(record))
    time.sleep(0.2)
    assert not marker.exists() and not target.exists(), "no engine started, nothing written"
