"""Fleet checks over ssh: a real sshd on loopback, started here with throwaway keys."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw.cli.remote import check_host, check_hosts, parse_hosts
from llmgw.host.netaddr import free_port

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
pytestmark = pytest.mark.skipif(not Path(SSHD).exists(),
                                reason="no sshd here (apt-get install openssh-server)")

# What `llmgw check --json` prints: one record a line.
RECORDS = ('{"step": "node", "promise": "agent-cert", "status": "passed", "message": ""}\n'
           '{"step": "node", "promise": "ready", "status": "failed",'
           ' "message": "n2 is not_ready"}\n'
           '{"step": "mirror", "promise": "bytes", "status": "skipped",'
           ' "message": "mirror: this machine is a node"}')


def _keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)


@pytest.fixture
def sshd(tmp_path: Path) -> Iterator[dict]:
    """Function: sshd on a free loopback port taking only a throwaway key; a fake `llmgw`
    on the PATH of its sessions prints two promise records."""
    _keygen(tmp_path / "host_key")
    _keygen(tmp_path / "client_key")
    (tmp_path / "authorized_keys").write_text((tmp_path / "client_key.pub").read_text())
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "llmgw").write_text(f"#!/bin/sh\necho '{RECORDS}'\n")
    (bin_dir / "llmgw").chmod(0o755)
    port = free_port()
    (tmp_path / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {tmp_path / 'host_key'}\n"
        f"AuthorizedKeysFile {tmp_path / 'authorized_keys'}\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\nUsePAM no\n"
        f"StrictModes no\nPidFile {tmp_path / 'sshd.pid'}\n"
        f"SetEnv PATH={bin_dir}:/usr/bin:/bin\n")
    Path("/run/sshd").mkdir(exist_ok=True)
    proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(tmp_path / "sshd_config")],
                            stderr=open(tmp_path / "sshd.log", "wb"))
    client = tmp_path / "ssh_config"
    client.write_text("Host *\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n"
                      "  LogLevel ERROR\n")
    try:
        deadline = time.monotonic() + 10
        while b"listening" not in (tmp_path / "sshd.log").read_bytes():
            assert proc.poll() is None and time.monotonic() < deadline, (
                (tmp_path / "sshd.log").read_text())
            time.sleep(0.1)
        yield {"spec": f"ssh://root@127.0.0.1:{port}", "ssh_config": str(client),
               "ssh_identity_file": str(tmp_path / "client_key"), "dir": tmp_path}
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_each_promise_comes_back_with_its_host(sshd: dict) -> None:
    records = check_host(sshd["spec"], ssh_config=sshd["ssh_config"],
                         ssh_identity_file=sshd["ssh_identity_file"])
    assert [(r.step, r.status) for r in records] == [
        ("node", "passed"), ("node", "failed"), ("mirror", "skipped")]
    assert all(r.host == "127.0.0.1" for r in records)
    assert records[1].message == "n2 is not_ready" and not records[1].ok
    assert records[1].test_id == "127.0.0.1::node/ready"


def test_negative_control_a_key_the_host_does_not_know_is_one_failed_record(
    sshd: dict, tmp_path: Path
) -> None:
    _keygen(tmp_path / "stranger")
    [record] = check_hosts([sshd["spec"]], ssh_config=sshd["ssh_config"],
                           ssh_identity_file=str(tmp_path / "stranger"))
    assert not record.ok and record.step == "ssh" and "255" in record.message


def test_a_host_without_llmgw_check_says_so(sshd: dict) -> None:
    (sshd["dir"] / "bin" / "llmgw").write_text("#!/bin/sh\necho 'usage: llmgw' >&2\nexit 2\n")
    [record] = check_host(sshd["spec"], ssh_config=sshd["ssh_config"],
                          ssh_identity_file=sshd["ssh_identity_file"])
    assert not record.ok and "new enough to have `check`" in record.message


def test_parse_hosts_keeps_order_and_drops_repeats() -> None:
    assert parse_hosts("ssh://root@a, ssh://root@b,ssh://root@a,") == [
        "ssh://root@a", "ssh://root@b"]


def _pytest_checks(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    root = Path(__file__).resolve().parents[1]
    return subprocess.run([sys.executable, "-m", "pytest", str(root / "checks"),
                           "-p", "no:randomly", "-p", "no:cacheprovider", *args],
                          cwd=root, capture_output=True, text=True, timeout=120)


def test_pytest_checks_hosts_gives_one_test_per_host_and_promise(
    sshd: dict, tmp_path: Path
) -> None:
    junit = tmp_path / "junit.xml"
    done = _pytest_checks("--hosts", sshd["spec"], "--ssh-config", sshd["ssh_config"],
                          "--ssh-identity-file", sshd["ssh_identity_file"],
                          f"--junitxml={junit}", "-rA", cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr  # one promise failed there
    out = done.stdout
    assert "PASSED checks/test_promises.py::test_on_host[127.0.0.1::node/agent-cert]" in out
    assert "test_on_host[127.0.0.1::node/ready]" in out and "n2 is not_ready" in out
    assert "SKIPPED" in out and "mirror: this machine is a node" in out
    cases = ET.parse(junit).getroot().iter("testcase")
    assert {(c.get("classname"), c.get("name")) for c in cases} == {
        ("127.0.0.1.node", "test_on_host[127.0.0.1::node/agent-cert]"),
        ("127.0.0.1.node", "test_on_host[127.0.0.1::node/ready]"),
        ("127.0.0.1.mirror", "test_on_host[127.0.0.1::mirror/bytes]"),
    }
    # Only the hosts were checked: no promise of this machine ran.
    assert "test_promise[" not in out


def test_without_hosts_checks_has_no_remote_test(tmp_path: Path) -> None:
    """The negative control: without --hosts, checks/ is this machine's promises alone."""
    done = _pytest_checks("--collect-only", "-q", "--state-dir", str(tmp_path / "none"),
                          cwd=tmp_path)
    assert "test_promise[pki/ca]" in done.stdout, done.stdout + done.stderr
    assert "test_on_host" not in done.stdout
