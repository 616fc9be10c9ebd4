"""`pytest provision/` and `pytest checks/` on a throwaway host: the foundation steps."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import httpx
import pytest

from tests.hosts import ThrowawayHost

FOUNDATION_ONLY = ("--no-mirror", "--no-node", "--no-starter")
# Live process state and logs change by themselves; everything else is the harness's.
# The store: each control plane beats its row and renews the scheduler lease every second.
VOLATILE = ("logs", "supervisor.sock", "supervisord.pid", "control.db", "control.db-wal",
            "control.db-shm")


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


def junit(path: Path) -> tuple[ET.Element, dict[str, str]]:
    """The report's testsuite, and each test's outcome by promise id."""
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    assert suite is not None
    outcomes = {}
    for case in suite.iter("testcase"):
        promise = case.get("name", "").removeprefix("test_promise[").removesuffix("]")
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcomes[promise] = kinds[0] if kinds else "passed"
    return suite, outcomes


def test_checks_fail_naming_the_control_plane_when_it_is_stopped(provisioned, tmp_path) -> None:
    """The control plane's service promise fails, naming it; the promises that need it are
    skipped naming it; pki's pass; no ERROR."""
    conf = provisioned.state_dir / "supervisord.conf"
    ctl = [sys.executable, "-m", "supervisor.supervisorctl", "-c", str(conf)]
    subprocess.run([*ctl, "stop", "llmgw-server"], check=True, capture_output=True)
    try:
        result = provisioned.checks(f"--junitxml={tmp_path / 'j.xml'}")
    finally:
        subprocess.run([*ctl, "start", "llmgw-server"], check=True, capture_output=True)
    assert result.returncode == 1, result.output
    assert "the control plane (llmgw-server) is not running" in result.output
    assert "start llmgw-server" in result.output
    suite, outcomes = junit(tmp_path / "j.xml")
    assert suite.get("errors") == "0", result.output
    assert {o for p, o in outcomes.items() if p.startswith("pki/")} == {"passed"}, outcomes
    assert outcomes["control_plane/service"] == "failure", outcomes
    for promise in ("admin-answers", "agent-api-cert", "agent-api-refuses-anonymous"):
        assert outcomes[f"control_plane/{promise}"] == "skipped", outcomes
    assert "control_plane/admin-answers: needs control_plane/service, which failed" in result.output
    assert outcomes["control_plane/config"] == "passed"
    assert provisioned.checks().returncode == 0, "started again, the checks pass again"


def test_a_ca_key_readable_by_others_one_failure_a_plan_then_a_fix(provisioned, tmp_path) -> None:
    """The issue's walk: checks fail once, naming key and mode; --plan says would and
    changes nothing; provision says done and why; then --plan has nothing to do."""
    key = provisioned.state_dir / "etc" / "pki" / "ca-key.pem"
    key.chmod(0o644)
    checks = provisioned.checks(f"--junitxml={tmp_path / 'j.xml'}")
    assert checks.returncode == 1, checks.output
    suite, outcomes = junit(tmp_path / "j.xml")
    assert suite.get("errors") == "0"
    assert [p for p, o in outcomes.items() if o == "failure"] == ["pki/ca-key-private"], outcomes
    (failed,) = checks.failed()
    assert f"{key} has mode 644" in checks.output and "pki/ca-key-private" in failed

    before = snapshot(provisioned.state_dir)
    plan = provisioned.provision(*FOUNDATION_ONLY, "--plan")
    assert plan.returncode == 1, plan.output
    assert plan.lines("would") == [f"pki: chmod 600 {key} (because {key} has mode 644)"]
    assert snapshot(provisioned.state_dir) == before, "--plan changed the host"
    assert key.stat().st_mode & 0o777 == 0o644

    fixed = provisioned.provision(*FOUNDATION_ONLY)
    assert fixed.returncode == 0, fixed.output
    assert fixed.lines("done") == [f"pki: chmod 600 {key} (because {key} has mode 644)"]
    again = provisioned.provision(*FOUNDATION_ONLY, "--plan")
    assert again.returncode == 0 and not again.lines("would"), again.output


def test_a_host_from_before_keys_keeps_its_open_gateway_and_checks_warn(provisioned) -> None:
    """server.yaml without gateway_keys, the gateway on every address: requests without a
    key are served, the owner's key is made anyway, and checks pass with a `!!` line."""
    import yaml

    from llmgw.host.netaddr import free_port

    server_yaml = provisioned.state_dir / "etc" / "server.yaml"
    before = server_yaml.read_text()
    data = yaml.safe_load(before)
    assert data["gateway_keys"] == "required", "a new host requires keys"
    del data["gateway_keys"]
    data["gateway_listen"] = f"0.0.0.0:{free_port()}"
    server_yaml.write_text(yaml.safe_dump(data))
    conf = provisioned.state_dir / "supervisord.conf"
    ctl = [sys.executable, "-m", "supervisor.supervisorctl", "-c", str(conf)]
    # A new listen address: the gateway binds it when it starts (a handover keeps sockets).
    subprocess.run([*ctl, "restart", "llmgw-gateway"], check=True, capture_output=True)
    try:
        checks = provisioned.checks()
        gateway = f"http://127.0.0.1:{data['gateway_listen'].rsplit(':', 1)[1]}"
        anonymous = httpx.get(f"{gateway}/v1/models", timeout=10)
    finally:
        server_yaml.write_text(before)
        subprocess.run([*ctl, "restart", "llmgw-gateway"], check=True, capture_output=True)
    assert checks.returncode == 0, checks.output
    assert anonymous.status_code == 200
    warned = [s["message"] for s in checks.steps if s["status"] == "warn"]
    assert any("answers anyone who reaches it" in w and "gateway_keys: required" in w
               for w in warned), checks.steps
    assert provisioned.gateway_key.startswith("sk-llmgw-")
    assert not [s for s in provisioned.checks().steps if s["status"] == "warn"], \
        "keys required again: no warning"
