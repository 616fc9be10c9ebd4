"""A provisioned local host, tried as an unprivileged local user would (`runuser -u nobody`):
without the admin token nothing can be managed, and with it the mirror still reads no file
outside its import dirs and the catalog passes no flag that is not the model's to tune."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.hosts import ThrowawayHost

NO_ENGINE = ("--no-node", "--no-starter")
SECRET = "the secret of root, mode 0600\n"


def _nobody_or_skip() -> list[str]:
    runuser = shutil.which("runuser")
    if os.geteuid() != 0 or runuser is None:
        pytest.skip("needs root and runuser to act as another user (runuser -u nobody)")
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("this machine has no user nobody to act as")
    if shutil.which("curl") is None:
        pytest.skip("needs curl for nobody's requests")
    return [runuser, "-u", "nobody", "--"]


@pytest.fixture(scope="module")
def host() -> Iterator[ThrowawayHost]:
    """Module: a host with control plane and mirror, in a folder every user may enter, so
    that only the files' own modes keep nobody out (as in /etc/llmgw)."""
    as_nobody = _nobody_or_skip()
    root = Path(tempfile.mkdtemp(prefix="llmgw-nobody-"))
    root.chmod(0o755)
    h = ThrowawayHost(root / "state")
    h.as_nobody = as_nobody
    h.secret = root / "secret.txt"
    h.secret.write_text(SECRET)
    h.secret.chmod(0o600)
    h.first_run = h.provision(*NO_ENGINE)
    try:
        yield h
    finally:
        h.down()
        shutil.rmtree(root, ignore_errors=True)


def nobody_curl(host: ThrowawayHost, method: str, url: str, body: dict | None = None,
                token: str | None = None) -> tuple[int, str]:
    """curl as nobody: the status and the body."""
    cmd = [*host.as_nobody, "curl", "-s", "-o", "-", "-w", "\n%{http_code}", "-X", method, url]
    if body is not None:
        cmd += ["-H", "Content-Type: application/json", "-d", json.dumps(body)]
    if token is not None:
        cmd += ["-H", f"Authorization: Bearer {token}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
    text, _, code = out.rpartition("\n")
    return int(code or 0), text


def model(args: list[str]) -> dict:
    return {"name": "evil", "source": "http://127.0.0.1:9/evil.gguf",
            "profiles": [{"name": "cpu", "engine": "llamacpp", "args": args}]}


def test_the_host_is_up_with_a_private_token(host) -> None:
    assert host.first_run.returncode == 0, host.first_run.output[-4000:]
    assert (host.token_path.stat().st_mode & 0o777) == 0o600
    assert any("admin token in" in line for line in host.first_run.lines("done"))
    denied = subprocess.run([*host.as_nobody, "cat", str(host.token_path)],
                            capture_output=True, text=True, timeout=30)
    assert denied.returncode != 0 and "Permission denied" in denied.stderr
    # The negative control: the folder does let nobody in, so the file's mode is what stops it.
    seen = subprocess.run([*host.as_nobody, "ls", str(host.token_path.parent)],
                          capture_output=True, text=True, timeout=30)
    assert seen.returncode == 0 and "admin-token" in seen.stdout, seen.stderr


@pytest.mark.parametrize("token", [None, "wrong"], ids=["anonymous", "wrong-token"])
def test_nobody_gets_401_from_both_apis_and_nothing_changes(host, token) -> None:
    fetch = {"source": host.secret.as_uri(), "model": "x", "version": "1"}
    for method, url, body in [
        ("POST", f"{host.mirror_api_url}/api/v1/fetch", fetch),
        ("GET", f"{host.mirror_api_url}/api/v1/models", None),
        ("POST", f"{host.admin_url}/api/v1/models", model([])),
        ("DELETE", f"{host.admin_url}/api/v1/models/evil", None),
        ("GET", f"{host.admin_url}/api/v1/nodes", None),
        ("GET", f"{host.admin_url}/metrics", None),
    ]:
        code, text = nobody_curl(host, method, url, body, token)
        assert code == 401, (method, url, code, text)
        assert str(host.token_path) in text, text
    code, _ = nobody_curl(host, "GET", f"{host.admin_url}/healthz")
    assert code == 200, "health needs no token"
    _assert_nothing_written_or_served(host)


def test_with_the_token_a_file_outside_the_import_dirs_is_403(host) -> None:
    fetch = {"source": host.secret.as_uri(), "model": "x", "version": "1"}
    r = httpx.post(f"{host.mirror_api_url}/api/v1/fetch", json=fetch, headers=host.auth)
    assert r.status_code == 403, r.text
    assert "import dirs (none)" in r.json()["detail"]
    _assert_nothing_written_or_served(host)


@pytest.mark.parametrize("flag", ["--api-key", "--host", "--log-file", "--model"])
def test_with_the_token_engine_flags_outside_the_allow_list_are_422(host, flag) -> None:
    target = host.state_dir.parent / f"written{flag}"
    r = httpx.post(f"{host.admin_url}/api/v1/models", json=model([flag, str(target)]),
                   headers=host.auth)
    assert r.status_code == 422 and f"engine flag {flag} is not allowed" in r.text, r.text
    assert not target.exists()
    assert host.admin().models() == []


def test_mirror_import_uploads_a_local_file_with_the_token(host, tiny_gguf) -> None:
    path, digest = tiny_gguf
    out = subprocess.run(
        [sys.executable, "-m", "llmgw", "mirror", "import", str(path), "--model", "tiny",
         "--version", "1", f"--state-dir={host.state_dir}"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    url = out.stdout.split(": ", 1)[1].split()[0]
    assert digest in out.stdout and httpx.get(url).status_code == 200


def test_checks_hold_the_token_mode_and_the_refusal(host) -> None:
    ok = host.checks()
    assert ok.returncode == 0, ok.output[-4000:]
    host.token_path.chmod(0o644)
    try:
        broken = host.checks()
    finally:
        host.token_path.chmod(0o600)
    assert broken.returncode != 0
    assert f"chmod 600 {host.token_path}" in broken.output, broken.output[-4000:]


def _assert_nothing_written_or_served(host: ThrowawayHost) -> None:
    models = host.state_dir / "models"
    assert not (models / "x").exists(), list(models.iterdir())
    bytes_url = f"http://127.0.0.1:{host.ports['mirror']}/x/1/{host.secret.name}"
    assert httpx.get(bytes_url).status_code == 404
    with httpx.Client(headers=host.auth) as c:
        assert c.get(f"{host.mirror_api_url}/api/v1/models/x/1").status_code == 404
    assert host.admin().models() == []


def test_a_host_without_a_token_gets_one_on_its_next_provision(host) -> None:
    """As a host provisioned before the token existed: the services refuse everyone (they
    have no hash), the checks say so, and the next provision makes the token, which the
    running services take up from its hash file without a restart."""
    host.token_path.unlink()
    host.token_path.with_name("admin-token.sha256").unlink()
    refused = httpx.get(f"{host.admin_url}/api/v1/models")
    assert refused.status_code == 401 and "pytest provision/" in refused.text
    broken = host.checks()
    assert broken.returncode != 0 and "admin-token does not exist" in broken.output
    again = host.provision(*NO_ENGINE)
    assert again.returncode == 0, again.output[-4000:]
    done = " ".join(again.lines("done"))
    assert "admin token in" in done, done
    assert host.checks().returncode == 0
    assert host.admin().models() == []
