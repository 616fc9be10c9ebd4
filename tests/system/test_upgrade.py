"""Upgrades of a system-mode host: from the llmgw before /opt/llmgw, losing nothing (same
CA, same config files, the old units kept as .bak); from this release to a newer one with
clients running; and to a release whose `pytest checks/` fail, which is rolled back."""

from __future__ import annotations

import hashlib
import json
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.system.container import SystemdContainer
from tests.system.test_system_mode import CLONE, MODEL, UNITS, ask, up, wait_for
from tests.tiny_gguf import write_tiny_gguf

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
OLD = "/root/llmgw-old"
NEXT = "/root/llmgw-next"
BROKEN = "/root/llmgw-broken"
GATEWAY_SOCKET = "/etc/systemd/system/llmgw-gateway.socket"
# The clients during an upgrade: bounded in count and in time, on loopback only.
MAX_REQUESTS = 5000
MAX_CLIENT_S = 900.0
KEPT = ("/etc/llmgw/pki/ca.pem", "/etc/llmgw/pki/ca-key.pem", "/etc/llmgw/agent.yaml",
        "/etc/llmgw/agent.pem")


def previous_release() -> str:
    """The last commit before llmgw installed itself into /opt/llmgw (the parent of the
    commit that first added its install module, src/llmgw/install.py, which issue 41 moved to
    src/llmgw/host/install.py: a log of the new path alone finds the move); '' when history
    does not reach it."""
    added = subprocess.run(
        ["git", "-C", str(ROOT), "log", "--diff-filter=A", "--format=%H", "--",
         "src/llmgw/install.py", "src/llmgw/host/install.py"],
        capture_output=True, text=True, check=False,
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
    wait_for("a chat completion through the gateway", lambda: ask(c), timeout_s=180)


def installed(c: SystemdContainer) -> str:
    """The label of the release /opt/llmgw/current names, e.g. `0.1.0 (abc1234)`."""
    data = json.loads(c.path("/opt/llmgw/current/llmgw-install.json").read_text())
    return f"{data['version']} ({data['commit']})" if data["commit"] else data["version"]


def release_at(c: SystemdContainer, clone: str, edit: tuple[str, str, str], why: str) -> str:
    """A clone of this checkout with one commit on top: in file, old replaced by new."""
    if not c.path(clone).exists():
        c.run("git", "clone", "-q", CLONE, clone)
    path, old, new = edit
    text = c.path(f"{clone}/{path}").read_text()
    assert old in text, f"{path} no longer holds {old!r}: update this test"
    c.path(f"{clone}/{path}").write_text(text.replace(old, new, 1))
    c.run("git", "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-qam", why,
          cwd=clone)
    return c.run("git", "rev-parse", "--short", "HEAD", cwd=clone).stdout.strip()


def this_release_serving(c: SystemdContainer) -> str:
    """This checkout provisioned (again) and serving; returns its release label."""
    if not c.path(MODEL).exists():
        write_tiny_gguf(c.path(MODEL))
        c.path(MODEL).chmod(0o644)
        c.path(MODEL).parent.chmod(0o755)
    proc, _ = up(c, "/root/this.json")
    assert proc.returncode == 0, proc.stdout[-6000:]
    wait_for("a chat completion through the gateway", lambda: ask(c), timeout_s=180)
    return installed(c)


class Clients:
    """Chat completions through the gateway, one after another, until stopped: every
    answer that is not a 200, and every connection error, is counted."""

    def __init__(self, c: SystemdContainer) -> None:
        self.c = c
        self.ok, self.failed, self.errors = 0, 0, []  # type: ignore[var-annotated]
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        began = time.monotonic()
        while (not self.stopping.is_set() and self.ok + self.failed < MAX_REQUESTS
               and time.monotonic() - began < MAX_CLIENT_S):
            try:
                ask(self.c, timeout_s=60)
                self.ok += 1
            except (httpx.HTTPError, AssertionError) as e:
                self.failed += 1
                self.errors.append(f"{type(e).__name__}: {str(e)[:200]}")

    def __enter__(self) -> Clients:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.thread.join(timeout=90)


def test_an_upgrade_with_clients_running_fails_no_request(
    systemd_container: SystemdContainer,
) -> None:
    """scripts/up from a newer commit onto the serving host while clients call the gateway:
    every request answered 200, none refused.

    This needs the gateway as its own socket-activated unit (llmgw-gateway.socket, issue
    16 part 1): systemd then holds the listening socket while the gateway restarts. While
    the gateway runs inside `llmgw server`, an upgrade's restart refuses connections for
    seconds, so this test is skipped on a host without that socket unit."""
    c = systemd_container
    before = this_release_serving(c)
    if not c.path(GATEWAY_SOCKET).exists():
        pytest.skip(f"no {GATEWAY_SOCKET}: the gateway still restarts with `llmgw server`, so "
                    "an upgrade drops connections (issue 16 part 1 makes it socket-activated)")
    commit = release_at(c, NEXT, ("src/llmgw/__init__.py", "\n", "\n# a newer release\n"),
                        "a newer release")
    with Clients(c) as clients:
        time.sleep(2)
        proc, _ = up(c, "/root/next.json", cwd=NEXT)
        time.sleep(2)
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert installed(c) == f"0.1.0 ({commit})" and installed(c) != before
    assert clients.ok > 0 and clients.failed == 0, (clients.ok, clients.failed,
                                                    clients.errors[:10])


def test_a_release_whose_checks_fail_is_rolled_back_naming_both(
    systemd_container: SystemdContainer,
) -> None:
    """scripts/up from a commit whose control plane exits at start: provisioning fails,
    `pytest checks/` fails, the previous release is current again and serves, and the run
    says which release was undone and which restored."""
    c = systemd_container
    before = this_release_serving(c)
    commit = release_at(
        c, BROKEN, ("src/llmgw/control/server.py", '    _raise_open_files()\n',
                    '    raise SystemExit("a broken release: its control plane exits at "\n'
                    '                     "start (tests/system/test_upgrade.py)")\n'),
        "a release whose control plane exits at start")
    broken = f"0.1.0 ({commit})"
    proc, _ = up(c, "/root/broken.json", cwd=BROKEN)
    out = proc.stdout
    assert proc.returncode != 0, out[-6000:]
    assert f"FAILED upgrade to llmgw {broken}: `pytest checks/` failed after it" in out, \
        out[-6000:]
    assert f"rolled back llmgw {broken} to {before} in /opt/llmgw" in out, out[-6000:]
    assert installed(c) == before
    assert not c.path("/opt/llmgw/pending-upgrade.json").exists()
    target = c.run("readlink", "-f", "/usr/local/bin/llmgw").stdout.strip()
    assert target.startswith("/opt/llmgw/releases/") and commit not in target, target
    wait_for("a chat completion through the gateway of the restored release", lambda: ask(c),
             timeout_s=180)
