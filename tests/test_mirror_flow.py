"""`pytest provision/` and `pytest checks/` on a throwaway host with the model mirror."""

from __future__ import annotations

import subprocess
import sys

import yaml

from tests.hosts import ThrowawayHost

MIRROR_ONLY = ("--no-node", "--no-starter")


def _stop_mirror(host: ThrowawayHost) -> None:
    conf = host.state_dir / "supervisord.conf"
    subprocess.run(
        [sys.executable, "-m", "supervisor.supervisorctl", "-c", str(conf), "stop", "llmgw-mirror"],
        check=True, capture_output=True, timeout=60,
    )


def test_mirror_provisions_keeps_and_checks_fail_when_it_stops(make_host) -> None:
    """Provision starts the mirror and points server.yaml at it (old file kept); checks pass;
    a second provision only keeps; with the mirror stopped, checks fail naming it."""
    host: ThrowawayHost = make_host()
    first = host.provision(*MIRROR_ONLY)
    assert first.returncode == 0, first.output
    done = " ".join(first.lines("done"))
    for what in ("model mirror in", "server.yaml points at the mirror", "probe file"):
        assert what in done, f"no done line for {what!r}: {first.steps}"
    etc = host.state_dir / "etc"
    api = f"http://127.0.0.1:{host.ports['mirror-api']}"
    listen = f"127.0.0.1:{host.ports['mirror']}"
    # url: where nodes download from, told to every node with its heartbeat's answer.
    assert yaml.safe_load((etc / "server.yaml").read_text())["mirror"] == {
        "api": api, "listen": listen, "url": f"http://{listen}"}
    backups = list(etc.glob("server.yaml.bak-*"))
    assert len(backups) == 1 and "mirror" not in yaml.safe_load(backups[0].read_text())

    checks = host.checks()
    assert checks.returncode == 0, checks.output
    assert not checks.skips("mirror"), checks.output

    second = host.provision(*MIRROR_ONLY)
    assert second.returncode == 0, second.output
    assert second.steps and "done" not in second.statuses(), second.steps
    assert len(list(etc.glob("server.yaml.bak-*"))) == 1, "a second run rewrote server.yaml"

    # A host provisioned before mirror.url existed gets it on its next run.
    server_yaml = etc / "server.yaml"
    server_yaml.write_text("".join(line for line in server_yaml.read_text().splitlines(True)
                                   if not line.strip().startswith("url:")))
    third = host.provision(*MIRROR_ONLY)
    assert third.returncode == 0, third.output
    assert any("tells nodes the mirror is at" in line for line in third.lines("done")), \
        third.steps
    assert yaml.safe_load(server_yaml.read_text())["mirror"]["url"] == f"http://{listen}"

    _stop_mirror(host)
    broken = host.checks()
    assert broken.returncode != 0, broken.output
    assert "llmgw-mirror" in broken.output and "Start the model mirror" in broken.output, (
        broken.output
    )


def test_checks_skip_the_mirror_on_a_host_provisioned_without_one(make_host) -> None:
    """After `provision --no-mirror`, plain `pytest checks/` passes: the mirror's checks skip
    and say why (server.yaml names no mirror)."""
    host: ThrowawayHost = make_host()
    first = host.provision("--no-mirror", *MIRROR_ONLY)
    assert first.returncode == 0, first.output
    checks = host.checks("-rs")
    assert checks.returncode == 0, checks.output
    assert "names no mirror" in checks.output, checks.output
