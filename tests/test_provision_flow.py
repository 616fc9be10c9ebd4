"""`pytest provision/` and `pytest checks/` on a throwaway host: the foundation steps."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.hosts import ThrowawayHost

FOUNDATION_ONLY = ("--no-mirror", "--no-node", "--no-starter")
# Live process state and logs change by themselves; everything else is the harness's.
VOLATILE = ("logs", "supervisor.sock", "supervisord.pid", "control.db-wal", "control.db-shm")


def snapshot(root: Path) -> dict[str, tuple[bytes, int, int]]:
    """Content, mode and mtime of every file the harness owns under root."""
    found = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if path.is_file() and not any(part in VOLATILE for part in rel.parts):
            st = path.stat()
            found[str(rel)] = (path.read_bytes(), st.st_mode, st.st_mtime_ns)
    return found


@pytest.fixture(scope="module")
def provisioned(tmp_path_factory) -> ThrowawayHost:
    host = ThrowawayHost(tmp_path_factory.mktemp("foundation") / "state")
    first = host.provision(*FOUNDATION_ONLY)
    host.first_run = first
    yield host
    host.down()


def test_first_run_reports_done_for_each_thing_it_made(provisioned) -> None:
    first = provisioned.first_run
    assert first.returncode == 0, first.output
    done = " ".join(first.lines("done"))
    for what in ("cluster CA", "server certificate", "server.yaml", "control plane started"):
        assert what in done, f"no done line for {what}: {first.steps}"


def test_second_run_keeps_everything(provisioned) -> None:
    second = provisioned.provision(*FOUNDATION_ONLY)
    assert second.returncode == 0, second.output
    assert second.steps and "done" not in second.statuses(), second.steps


def test_checks_pass_and_change_nothing(provisioned) -> None:
    before = snapshot(provisioned.state_dir)
    assert any(name.endswith("ca-key.pem") for name in before)
    assert any(name.endswith("llmgw-server.conf") for name in before)
    result = provisioned.checks()
    assert result.returncode == 0, result.output
    assert snapshot(provisioned.state_dir) == before


def test_checks_fail_naming_the_control_plane_when_it_is_stopped(provisioned) -> None:
    conf = provisioned.state_dir / "supervisord.conf"
    ctl = [sys.executable, "-m", "supervisor.supervisorctl", "-c", str(conf)]
    subprocess.run([*ctl, "stop", "llmgw-server"], check=True, capture_output=True)
    try:
        result = provisioned.checks()
    finally:
        subprocess.run([*ctl, "start", "llmgw-server"], check=True, capture_output=True)
    assert result.returncode != 0
    assert "the control plane (llmgw-server) is not running" in result.output
    assert "start llmgw-server" in result.output
    assert provisioned.checks().returncode == 0, "started again, the checks pass again"
