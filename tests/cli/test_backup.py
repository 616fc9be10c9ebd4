"""`llmgw backup`, `llmgw restore` and `llmgw store migrate` as a person runs them: what they
print, the files they leave, and what they refuse."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from llmgw import cli, config
from llmgw.control.store import Store
from llmgw.control.store.copy import compare, read
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
