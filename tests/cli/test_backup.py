"""`llmgw backup`, `llmgw restore` and `llmgw store migrate` as a person runs them: what they
print, the files they leave, and what they refuse."""

from __future__ import annotations

import logging
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from llmgw import cli, config
from llmgw.host.netaddr import free_port
from llmgw.store import Store
from llmgw.store.copy import compare, read
from tests.postgres import PASSWORD
from tests.test_backup import _control_plane


def test_backup_then_restore_with_a_passphrase(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    _control_plane(tmp_path / "a")
    secret = tmp_path / "passphrase"
    secret.write_text("correct horse\n")
    out = tmp_path / "cp.backup"
    assert cli.main(["backup", "--out", str(out), "--state-dir", str(tmp_path / "a"),
                     "--mode", "local", "--passphrase-file", str(secret)]) == 0
    said = capsys.readouterr().out
    assert "(0600, encrypted): 1 nodes, 1 models, 1 keys" in said, said
    assert cli.main(["restore", str(out), "--state-dir", str(tmp_path / "b"),
                     "--mode", "local"]) == 1, "control: without the passphrase, refused"
    assert "is encrypted" in capsys.readouterr().err
    assert cli.main(["restore", str(out), "--state-dir", str(tmp_path / "b"), "--mode",
                     "local", "--passphrase-file", str(secret)]) == 0
    said = capsys.readouterr().out
    assert "restored the control plane" in said and "pytest provision/ --state-dir" in said


def test_store_migrate_moves_every_row_to_postgresql_and_names_it_in_server_yaml(
        tmp_path: Path, postgres_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    layout = _control_plane(tmp_path / "a")
    before = read(Store(config.load_server(layout.server_yaml).store_at(), migrate=False))
    assert cli.main(["store", "migrate", "--to", postgres_url, "--state-dir",
                     str(tmp_path / "a"), "--mode", "local"]) == 0
    said = capsys.readouterr().out
    assert "every table's row count and sha256 digest are equal" in said, said
    moved = config.load_server(layout.server_yaml)
    assert moved.store == postgres_url
    after = read(Store(postgres_url))
    assert compare(before, after) == [] and after.counts()["nodes"] == 1
    assert list(layout.etc.glob("server.yaml.before-store-migrate-*")), "the old file kept"
    # Again: the store is already that one.
    assert cli.main(["store", "migrate", "--to", postgres_url, "--state-dir",
                     str(tmp_path / "a"), "--mode", "local"]) == 1
    assert "already" in capsys.readouterr().err


def test_store_migrate_refuses_while_the_control_plane_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    layout = _control_plane(tmp_path / "a")
    server = config.load_server(layout.server_yaml)
    host, port = config.parse_listen(server.admin_listen)
    with socket.socket() as listener:  # something answers at the admin API's address
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((host, port))
        except OSError:
            pytest.skip(f"{server.admin_listen} is taken on this machine")
        listener.listen()
        assert cli.main(["store", "migrate", "--to", str(tmp_path / "new.db"),
                         "--state-dir", str(tmp_path / "a"), "--mode", "local"]) == 1
    err = capsys.readouterr().err
    assert "the control plane (127.0.0.1:9090) still runs" in err and "llmgw down" in err
    assert not (tmp_path / "new.db").exists()
    assert cli.main(["store", "migrate", "--to", str(tmp_path / "new.db"), "--state-dir",
                     str(tmp_path / "a"), "--mode", "local"]) == 0, "control: stopped, moved"


# A store that refuses, as PostgreSQL refuses it: each made from a good URL of the test
# server (a user that must give its password), with what the one line must say.
REFUSALS = {
    "a wrong password": (lambda url: url.replace(PASSWORD, "not-it"),
                         'password authentication failed for user "llmgw_pw"; check the user '
                         "and password"),
    "a dead port": (lambda url: re.sub(r":\d+/", f":{free_port()}/", url),
                    "Connection refused; is PostgreSQL running there"),
    "a missing database": (lambda url: url.rsplit("/", 1)[0] + "/nosuchdb",
                           'database "nosuchdb" does not exist; create it first'),
}


def _one_line(err: str, said: str, caplog: pytest.LogCaptureFixture) -> None:
    __tracebackhide__ = True
    lines = err.strip().splitlines()
    assert len(lines) == 1 and said in lines[0], err
    assert "Background on this error" not in err and "Traceback" not in err, err
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def _state(tmp_path: Path, name: str) -> list[str]:
    return ["--state-dir", str(tmp_path / name), "--mode", "local"]


@pytest.mark.parametrize("case", REFUSALS)
def test_restore_into_a_store_that_refuses_says_why_in_one_line_and_writes_nothing(
        tmp_path: Path, postgres_password_url: str, case: str,
        capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    _control_plane(tmp_path / "a")
    out = tmp_path / "cp.backup"
    assert cli.main(["backup", "--out", str(out), *_state(tmp_path, "a")]) == 0
    broken, said = REFUSALS[case]
    assert cli.main(["restore", str(out), "--store", broken(postgres_password_url),
                     *_state(tmp_path, "b")]) == 1
    _one_line(capsys.readouterr().err, said, caplog)
    assert not (tmp_path / "b").exists(), "nothing written"
    assert cli.main(["restore", str(out), "--store", postgres_password_url,
                     *_state(tmp_path, "b")]) == 0, "control: the store as it is"


@pytest.mark.parametrize("case", REFUSALS)
def test_store_migrate_to_a_store_that_refuses_says_why_in_one_line_and_changes_nothing(
        tmp_path: Path, postgres_password_url: str, case: str,
        capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    layout = _control_plane(tmp_path / "a")
    before = layout.server_yaml.read_bytes()
    broken, said = REFUSALS[case]
    assert cli.main(["store", "migrate", "--to", broken(postgres_password_url),
                     *_state(tmp_path, "a")]) == 1
    err = capsys.readouterr().err
    _one_line(err, said, caplog)
    assert "nothing changed: server.yaml still names" in err
    assert PASSWORD not in err, "a URL's password is never shown"
    assert layout.server_yaml.read_bytes() == before
    assert not list(layout.etc.glob("server.yaml.before-*"))
    assert cli.main(["store", "migrate", "--to", postgres_password_url,
                     *_state(tmp_path, "a")]) == 0, "control: the store as it is"


def test_a_refusing_store_is_one_line_on_stderr_of_the_real_command(
        tmp_path: Path, postgres_password_url: str) -> None:
    """As a person sees it: the process's whole stderr (its log lines too) is one line."""
    _control_plane(tmp_path / "a")
    out = tmp_path / "cp.backup"
    assert cli.main(["backup", "--out", str(out), *_state(tmp_path, "a")]) == 0
    done = subprocess.run(
        [sys.executable, "-m", "llmgw", "restore", str(out), "--store",
         postgres_password_url.replace(PASSWORD, "not-it"), *_state(tmp_path, "b")],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("llmgw restore: the store")
    assert "password authentication failed" in done.stderr, done.stderr


@pytest.mark.parametrize("mode", [0o640, 0o600], ids=["0640", "0600"])
def test_store_migrate_keeps_server_yaml_s_mode_and_its_old_copy_has_it_too(
        tmp_path: Path, postgres_url: str, mode: int) -> None:
    layout = _control_plane(tmp_path / "a")
    layout.server_yaml.chmod(mode)
    assert cli.main(["store", "migrate", "--to", postgres_url, *_state(tmp_path, "a")]) == 0
    [old] = layout.etc.glob("server.yaml.before-store-migrate-*")
    assert layout.server_yaml.stat().st_mode & 0o777 == mode
    assert old.stat().st_mode & 0o777 == mode


def test_store_migrate_makes_a_server_yaml_open_to_all_0640(
        tmp_path: Path, postgres_url: str) -> None:
    """The URL it writes may carry a password: never readable by every user."""
    layout = _control_plane(tmp_path / "a")
    layout.server_yaml.chmod(0o644)
    assert cli.main(["store", "migrate", "--to", postgres_url, *_state(tmp_path, "a")]) == 0
    [old] = layout.etc.glob("server.yaml.before-store-migrate-*")
    assert layout.server_yaml.stat().st_mode & 0o777 == 0o640
    assert old.stat().st_mode & 0o777 == 0o640


@pytest.mark.parametrize(("how", "said"), [
    ("cut", "is cut short: its compressed data stops"),
    ("crc", "is damaged (CRC check failed"),
])
def test_restore_of_a_damaged_file_says_so_in_one_line_and_writes_nothing(
        tmp_path: Path, how: str, said: str, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    _control_plane(tmp_path / "a")
    out = tmp_path / "cp.backup"
    assert cli.main(["backup", "--out", str(out), *_state(tmp_path, "a")]) == 0
    good = out.read_bytes()
    damaged = bytearray(good)
    if how == "cut":
        damaged = damaged[:len(good) // 2]
    else:
        damaged[-8] ^= 1
    out.write_bytes(bytes(damaged))
    assert cli.main(["restore", str(out), *_state(tmp_path, "b")]) == 1
    _one_line(capsys.readouterr().err, said, caplog)
    assert not (tmp_path / "b").exists(), "nothing written"
    out.write_bytes(good)
    assert cli.main(["restore", str(out), *_state(tmp_path, "b")]) == 0, "control: whole"


def test_backup_and_store_migrate_without_a_control_plane_exit_3(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """3 is the documented status for no control plane here, as `llmgw status` gives."""
    out = tmp_path / "cp.backup"
    assert cli.main(["backup", "--out", str(out), *_state(tmp_path, "none")]) == 3
    assert "no control plane here" in capsys.readouterr().err and not out.exists()
    assert cli.main(["store", "migrate", "--to", str(tmp_path / "x.db"),
                     *_state(tmp_path, "none")]) == 3
    assert "no control plane here" in capsys.readouterr().err
    _control_plane(tmp_path / "a")
    assert cli.main(["backup", "--out", str(out), *_state(tmp_path, "a")]) == 0, \
        "control: a control plane is here"


def test_a_backup_into_a_folder_that_cannot_be_written_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _control_plane(tmp_path / "a")
    assert cli.main(["backup", "--out", "/proc/llmgw.cli.backup", *_state(tmp_path, "a")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("llmgw backup: cannot write /proc/llmgw.cli.backup") and \
        err.count("\n") == 1, err
    out = tmp_path / "cp.backup"
    assert cli.main(["backup", "--out", str(out), *_state(tmp_path, "a")]) == 0, "control"
