"""llmgw.cli.backup: a control plane's authority in one file (0600, optionally encrypted), read
back whole or refused, restored into a new state dir of either store backend."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from llmgw import config
from llmgw.cli import backup
from llmgw.host import pki
from llmgw.host.layout import Layout
from llmgw.store import Store

KEY = {"id": "k1", "name": "ci", "prefix": "sk-llmgw-abcd", "hash": "h1", "rpm": 0, "tpm": 0,
       "expires": None, "models": []}


def _control_plane(root: Path, store: str = "") -> Layout:
    """A local-mode control plane's files, as provision leaves them, and a store with a
    node, a model and a key."""
    layout = Layout.for_mode("local", root)
    layout.pki.mkdir(parents=True)
    ca = pki.create_ca()
    ca.write(layout.pki, "ca")
    pki.issue_server(ca, ["127.0.0.1"]).write(layout.pki, "server")
    server = config.ServerConfig(
        state_dir=str(layout.server_state), store=store,
        tls=config.TLSFiles(ca=str(layout.ca_cert), cert=str(layout.server_cert),
                            key=str(layout.server_key)))
    layout.server_yaml.write_text(config.render(server, "# server.yaml\n"))
    layout.admin_token.write_text("admin-secret\n")
    layout.admin_token.chmod(0o600)
    s = Store(server.store_at())
    s.record_heartbeat("n2", {"cpus": 2}, serial="S1")
    s.add_cert("S1", "n2", 2e9)
    s.add_model({"name": "m", "source": "http://x/m.gguf"})
    s.add_key(KEY)
    s.close()
    return layout


def test_a_backup_is_0600_and_restores_into_a_new_state_dir_with_its_paths_moved(
        tmp_path: Path) -> None:
    old = _control_plane(tmp_path / "a")
    out = tmp_path / "cp.backup"
    manifest = backup.make(old, out)
    assert out.stat().st_mode & 0o777 == 0o600
    assert manifest["counts"]["nodes"] == 1 and manifest["counts"]["keys"] == 1
    assert b"admin-secret" in __import__("gzip").decompress(out.read_bytes()), \
        "control: unencrypted, the token is in the file"

    new = Layout.for_mode("local", tmp_path / "b")
    lines = backup.restore(backup.load(out), new)
    assert "1 nodes, 1 models, 1 keys" in lines[0] and "--state-dir" in lines[-1]
    restored = config.load_server(new.server_yaml)
    assert restored.state_dir == str(new.server_state), "the paths moved to the new dir"
    assert str(tmp_path / "a") not in new.server_yaml.read_text()
    assert new.ca_key.read_bytes() == old.ca_key.read_bytes()
    assert new.ca_key.stat().st_mode & 0o777 == 0o600
    assert new.admin_token.stat().st_mode & 0o777 == 0o600
    store = Store(restored.store_at())
    assert [n["id"] for n in store.nodes()] == ["n2"] and store.node_known("n2")
    assert [k["name"] for k in store.keys()] == ["ci"]
    store.close()


def test_an_encrypted_backup_needs_its_passphrase_and_a_changed_byte_fails_whole(
        tmp_path: Path) -> None:
    layout = _control_plane(tmp_path / "a")
    out = tmp_path / "cp.backup"
    backup.make(layout, out, b"correct horse")
    data = out.read_bytes()
    assert data.startswith(backup.ENCRYPTED) and b"admin-secret" not in data
    assert backup.load(out, b"correct horse").manifest["counts"]["models"] == 1
    with pytest.raises(backup.BackupError, match="is encrypted: give its passphrase"):
        backup.load(out)
    with pytest.raises(backup.BackupError, match="passphrase does not open"):
        backup.load(out, b"wrong")
    changed = bytearray(data)
    changed[-10] ^= 1
    out.write_bytes(bytes(changed))
    with pytest.raises(backup.BackupError, match="or the file was changed"):
        backup.load(out, b"correct horse")


def test_a_backup_is_never_written_over_a_file_nor_restored_over_a_control_plane(
        tmp_path: Path) -> None:
    layout = _control_plane(tmp_path / "a")
    out = tmp_path / "cp.backup"
    out.write_text("keep me")
    with pytest.raises(backup.BackupError, match="never written over a file"):
        backup.make(layout, out)
    assert out.read_text() == "keep me"
    out.unlink()
    backup.make(layout, out)
    with pytest.raises(backup.BackupError, match="already has .*ca.pem"):
        backup.restore(backup.load(out), layout)
    with pytest.raises(backup.BackupError, match="local-mode host; restore it in local"):
        backup.restore(backup.load(out), Layout.for_mode("system"))


def test_a_damaged_store_copy_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    import gzip
    import io
    import tarfile

    layout = _control_plane(tmp_path / "a")
    out = tmp_path / "cp.backup"
    backup.make(layout, out)
    members = {}
    with tarfile.open(out, "r:gz") as tar:
        for m in tar.getmembers():
            members[m.name] = tar.extractfile(m).read()  # type: ignore[union-attr]
    members["store.json"] = members["store.json"].replace(b'"ci"', b'"cj"')
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, body in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    out.write_bytes(gzip.compress(buf.getvalue()))
    new = Layout.for_mode("local", tmp_path / "b")
    with pytest.raises(backup.BackupError, match="do not match the digests"):
        backup.restore(backup.load(out), new)
    assert not new.etc.exists(), "nothing written"


def test_a_sqlite_host_restores_onto_postgresql(tmp_path: Path, postgres_url: str) -> None:
    layout = _control_plane(tmp_path / "a")
    out = tmp_path / "cp.backup"
    backup.make(layout, out)
    new = Layout.for_mode("local", tmp_path / "b")
    backup.restore(backup.load(out), new, store_url=postgres_url)
    restored = config.load_server(new.server_yaml)
    assert restored.store == postgres_url
    assert yaml.safe_load(new.server_yaml.read_text())["store"] == postgres_url
    store = Store(postgres_url)
    assert store.backend == "postgresql" and [m["name"] for m in store.models()] == ["m"]
    assert store.revoked_serials() == [] and store.node_known("n2")
    store.close()
    # And a second restore into the same, now full, database is refused.
    with pytest.raises(backup.BackupError, match="already holds"):
        backup.restore(backup.load(out), Layout.for_mode("local", tmp_path / "c"),
                       store_url=postgres_url)


def _damaged(path: Path, at: int, length: int | None = None) -> None:
    """path with the byte at `at` flipped, or cut to length bytes."""
    data = bytearray(path.read_bytes())
    if length is not None:
        data = data[:length]
    else:
        data[at] ^= 0x20
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(("passphrase", "length", "said"), [
    (None, 0.5, "is cut short: its compressed data stops"),
    (b"correct horse", 40, "is cut short: 40 bytes, where an encrypted backup has 69"),
    (b"correct horse", 0.5, "or the file was changed since it was made (cut short"),
], ids=["plain-half", "encrypted-40-bytes", "encrypted-half"])
def test_a_backup_cut_short_is_refused_in_one_line(
        tmp_path: Path, passphrase: bytes | None, length: float, said: str) -> None:
    layout = _control_plane(tmp_path / "a")
    out = tmp_path / "cp.backup"
    backup.make(layout, out, passphrase)
    assert backup.load(out, passphrase).manifest["counts"]["keys"] == 1, "control: whole"
    _damaged(out, 0, int(length * out.stat().st_size) if length < 1 else int(length))
    with pytest.raises(backup.BackupError, match=re.escape(said)) as refused:
        backup.load(out, passphrase)
    assert "\n" not in str(refused.value)


def test_a_plain_backup_whose_gzip_checksum_is_damaged_is_refused(tmp_path: Path) -> None:
    """tar reads a gzipped archive only as far as its last member: the checksum at the end
    is checked only when the file is read to the end, as load does."""
    import io
    import tarfile

    layout = _control_plane(tmp_path / "a")
    out = tmp_path / "cp.backup"
    backup.make(layout, out)
    _damaged(out, -8)  # the first byte of gzip's CRC-32 trailer
    with tarfile.open(fileobj=io.BytesIO(out.read_bytes()), mode="r:gz") as tar:
        assert "manifest.json" in tar.getnames(), "control: tar alone reads it as whole"
    with pytest.raises(backup.BackupError, match="is damaged .*CRC check failed.*use another"):
        backup.load(out)


def test_an_encrypted_backup_with_its_first_line_changed_is_said_to_be_damaged(
        tmp_path: Path) -> None:
    layout = _control_plane(tmp_path / "a")
    encrypted, plain = tmp_path / "encrypted.backup", tmp_path / "plain.backup"
    backup.make(layout, encrypted, b"correct horse")
    backup.make(layout, plain)
    _damaged(encrypted, 3)
    for passphrase in (b"correct horse", None):
        with pytest.raises(backup.BackupError, match="first line, which marks an encrypted "
                                                     "backup, is damaged") as refused:
            backup.load(encrypted, passphrase)
        assert "not encrypted" not in str(refused.value)
    # The controls: a plain backup given a passphrase is said to be one; another file is
    # said to be no backup at all.
    with pytest.raises(backup.BackupError, match="is not encrypted, yet a passphrase"):
        backup.load(plain, b"correct horse")
    (tmp_path / "notes.txt").write_text("a shopping list, long enough to be a header\n")
    with pytest.raises(backup.BackupError, match="is not an llmgw backup: it starts neither"):
        backup.load(tmp_path / "notes.txt")


@pytest.mark.parametrize(("mode", "restored"), [(0o640, 0o640), (0o600, 0o600),
                                                (0o644, 0o640)], ids=["0640", "0600", "0644"])
def test_server_yaml_is_restored_with_its_mode_never_looser_than_0640(
        tmp_path: Path, mode: int, restored: int) -> None:
    """server.yaml may hold the store's password: its mode comes back as it was backed up,
    0640 at most; the keys stay 0600 and the certificates 0644."""
    layout = _control_plane(tmp_path / "a")
    layout.server_yaml.chmod(mode)
    out = tmp_path / "cp.backup"
    backup.make(layout, out)
    new = Layout.for_mode("local", tmp_path / "b")
    backup.restore(backup.load(out), new)
    assert new.server_yaml.stat().st_mode & 0o777 == restored
    assert new.ca_key.stat().st_mode & 0o777 == 0o600
    assert new.ca_cert.stat().st_mode & 0o777 == 0o644


def test_a_backup_made_before_modes_were_kept_restores_server_yaml_0640(
        tmp_path: Path) -> None:
    layout = _control_plane(tmp_path / "a")
    out = tmp_path / "cp.backup"
    backup.make(layout, out)
    found = backup.load(out)
    del found.manifest["modes"]
    new = Layout.for_mode("local", tmp_path / "b")
    backup.restore(found, new)
    assert new.server_yaml.stat().st_mode & 0o777 == 0o640
