"""A host provisioned by the llmgw before the installed one is upgraded by a re-run with
this one, losing nothing: same CA, same config files, the old units kept as .bak."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest

from tests.system.container import SystemdContainer
from tests.system.test_system_mode import MODEL, UNITS, ask, up, wait_for
from tests.tiny_gguf import write_tiny_gguf

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
OLD = "/root/llmgw-old"
KEPT = ("/etc/llmgw/pki/ca.pem", "/etc/llmgw/pki/ca-key.pem", "/etc/llmgw/agent.yaml",
        "/etc/llmgw/agent.pem")


def previous_release() -> str:
    """The last commit before llmgw installed itself into /opt/llmgw (the parent of the
    commit that added src/llmgw/install.py); '' when history does not reach it."""
    added = subprocess.run(
        ["git", "-C", str(ROOT), "log", "--diff-filter=A", "--format=%H", "--",
         "src/llmgw/install.py"], capture_output=True, text=True, check=False,
    ).stdout.split()
    return f"{added[-1]}^" if added else ""


def digests(c: SystemdContainer, paths: tuple[str, ...]) -> dict[str, str]:
    return {p: hashlib.sha256(c.path(p).read_bytes()).hexdigest() for p in paths}


def test_a_host_of_the_previous_release_is_upgraded_in_place(
    systemd_container: SystemdContainer,
) -> None:
    c = systemd_container
    old = previous_release()
    if not old:
        pytest.skip("this clone's history does not reach the release before /opt/llmgw")
    write_tiny_gguf(c.path(MODEL))
    c.path(MODEL).chmod(0o644)
    c.path(MODEL).parent.chmod(0o755)
    c.run("git", "clone", "-q", "/root/llmgw", OLD)
    c.run("git", "checkout", "-q", old, cwd=OLD)
    # The previous release runs every unit from its clone under /root: the mirror, as
    # user llmgw, cannot run it, so this run fails (the bug this release fixes); what it
    # wrote must survive the upgrade.
    c.run("bash", "scripts/up", "--advertise", "127.0.0.1", "--no-starter", cwd=OLD,
          check=False, timeout=1800)
    before = digests(c, KEPT)
    old_unit = c.path("/etc/systemd/system/llmgw-server.service").read_text()
    assert f"{OLD}/.venv/bin/llmgw" in old_unit, old_unit

    proc, steps = up(c, "/root/upgrade.json")
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert digests(c, KEPT) == before
    assert c.path("/etc/systemd/system/llmgw-server.service.bak").read_text() == old_unit
    for unit in UNITS:
        assert "path=/usr/local/bin/llmgw " in c.show(unit, "ExecStart")["ExecStart"], unit
    kept = [s["message"] for s in steps if s["status"] == "kept"]
    assert any("agent certificate for" in k for k in kept), kept
    wait_for("a chat completion through the gateway", ask, timeout_s=180)
