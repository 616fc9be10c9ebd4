"""`llmgw backup` and `llmgw restore`: a control plane's authority in one file.

A backup holds what no other machine of the fleet has: the cluster CA and its key, the
control plane's server certificate and key (nodes pin the CA and dial its address), the
admin credential (the token and its hash), the owner's gateway key, server.yaml, and a
consistent copy of the store (every table read from one snapshot: store/copy.py).
It is a gzipped tar, 0600, optionally encrypted with a passphrase (scrypt, then AES-256-GCM:
a changed byte or a wrong passphrase fails whole, never restores half).

Restore brings a new machine (or a new state dir) up as that control plane: the files put
back with their modes, server.yaml's paths moved to this layout, the store written into an
empty one of either backend and compared with the backup's digests; then `pytest
provision/` starts the services, finding everything kept.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import socket
import stat
import tarfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

from llmgw import __version__
from llmgw.config import ConfigError, ServerConfig, load_server, parse
from llmgw.errors import Error
from llmgw.host.files import atomic_write
from llmgw.host.layout import Layout

ENCRYPTED = b"LLMGW-BACKUP-AES256GCM-1\n"
_GZIP = b"\x1f\x8b"
_SALT, _NONCE, _TAG = 16, 12, 16
# The files of a backup: their name in it, the Layout path they come from and go to, the
# loosest mode it is restored with (its mode when backed up, never looser: server.yaml may
# hold the store's password), and whether a control plane has it whatever its options.
FILES = (
    ("ca.pem", "ca_cert", 0o644, True),
    ("ca-key.pem", "ca_key", 0o600, True),
    ("server.pem", "server_cert", 0o644, True),
    ("server-key.pem", "server_key", 0o600, True),
    ("server.yaml", "server_yaml", 0o640, True),
    ("admin-token", "admin_token", 0o600, False),
    ("admin-token.sha256", "admin_token_hash", 0o644, False),
    ("gateway-key", "gateway_key", 0o600, False),
)


class BackupError(Error):
    """A backup that cannot be made, read or restored; says what and what to do."""


@dataclass(frozen=True)
class Backup:
    """A backup as read: what it says of itself, its files, and the store's rows."""

    manifest: dict[str, Any]
    files: dict[str, bytes]
    store: dict[str, Any] = field(repr=False)


def read_passphrase(path: str | None) -> bytes | None:
    """The passphrase in a file (its last newline dropped), or None without one."""
    if path is None:
        return None
    try:
        text = Path(path).read_bytes().rstrip(b"\r\n")
    except OSError as e:
        raise BackupError(f"cannot read the passphrase file: {e}") from None
    if not text:
        raise BackupError(f"the passphrase file {path} is empty; write the passphrase in it")
    return text


# --- making one ---

def make(layout: Layout, out: Path, passphrase: bytes | None = None) -> dict[str, Any]:
    """Write this host's backup to out (0600; never over an existing file); its manifest."""
    from llmgw.store import SchemaError, Store, StoreError, refusal
    from llmgw.store import copy as store_copy

    if out.exists():
        raise BackupError(f"{out} exists; a backup is never written over a file: name "
                          "another, or move that one away")
    try:
        config = load_server(layout.server_yaml)
    except ConfigError as e:
        raise BackupError(f"no control plane to back up here: {e}; pass the --mode and "
                          "--state-dir of a provisioned host") from None
    missing = [str(getattr(layout, attr)) for _, attr, _, needed in FILES
               if needed and not getattr(layout, attr).is_file()]
    if missing:
        raise BackupError(f"this control plane lacks {', '.join(missing)}; `pytest "
                          "provision/` makes them, or this is not the machine it was")
    try:
        store = Store(config.store_at(), migrate=False)
    except SchemaError as e:
        raise BackupError(f"cannot read the store: {e}") from None
    except StoreError as e:
        raise BackupError(f"cannot read the store: {refusal(e, config.store_at())}") from None
    try:
        rows = store_copy.read(store)
    except StoreError as e:
        raise BackupError(f"cannot read the store: {refusal(e, config.store_at())}") from None
    finally:
        store.close()
    paths = {name: getattr(layout, attr) for name, attr, _, _ in FILES
             if getattr(layout, attr).is_file()}
    files = {name: path.read_bytes() for name, path in paths.items()}
    manifest = {
        "llmgw": __version__, "created": time.time(), "host": socket.gethostname(),
        "mode": layout.mode, "root": str(layout.root or ""),
        "backend": store.backend, "revision": rows.revision,
        "counts": rows.counts(), "digests": rows.digests(), "files": sorted(files),
        "modes": {name: stat.S_IMODE(path.stat().st_mode) for name, path in paths.items()},
    }
    archive = _tar({"manifest.json": _json(manifest),
                    "store.json": _json({"revision": rows.revision, "rows": rows.rows}),
                    **{f"files/{name}": data for name, data in files.items()}})
    try:
        atomic_write(out, _seal(archive, passphrase) if passphrase else archive, mode=0o600)
    except OSError as e:
        raise BackupError(f"cannot write {out}: {e.strerror or e}; name a file in a folder "
                          "you may write") from None
    return manifest


def _json(data: Any) -> bytes:
    return json.dumps(data, indent=1, sort_keys=True).encode()


def _tar(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o600, int(time.time())
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _key(passphrase: bytes, salt: bytes) -> bytes:
    return Scrypt(salt=salt, length=32, n=2**15, r=8, p=1).derive(passphrase)


def _seal(data: bytes, passphrase: bytes) -> bytes:
    salt, nonce = os.urandom(_SALT), os.urandom(_NONCE)
    return ENCRYPTED + salt + nonce + AESGCM(_key(passphrase, salt)).encrypt(
        nonce, data, ENCRYPTED)


# --- reading one ---

def load(path: Path, passphrase: bytes | None = None) -> Backup:
    """A backup read whole and checked: its encryption or gzip's checksum, then its store's
    rows against the manifest's digests. BackupError, in one line, for anything less."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise BackupError(f"cannot read the backup: {e}") from None
    members = _members(path, _gunzip(path, _opened(path, data, passphrase)))
    try:
        manifest = json.loads(members["manifest.json"])
        store = json.loads(members["store.json"])
    except (KeyError, ValueError) as e:
        raise BackupError(f"{path} is not an llmgw backup, or is damaged ({e!r} unreadable); "
                          "`llmgw backup --out FILE` makes one") from None
    if not isinstance(manifest, dict) or not isinstance(store, dict):
        raise BackupError(f"{path} is damaged: its manifest or store is not what `llmgw "
                          "backup` writes; use another copy")
    files = {name.removeprefix("files/"): body for name, body in members.items()
             if name.startswith("files/")}
    backup = Backup(manifest, files, store)
    _verify(path, backup)
    return backup


def _opened(path: Path, data: bytes, passphrase: bytes | None) -> bytes:
    """The gzipped archive in data: decrypted with passphrase when the file is encrypted."""
    if data.startswith(ENCRYPTED):
        if passphrase is None:
            raise BackupError(f"{path} is encrypted: give its passphrase with "
                              "--passphrase-file FILE")
        return _unseal(path, data, passphrase)
    if not data.startswith(_GZIP):
        raise BackupError(_not_a_backup(path, data))
    if passphrase is not None:
        raise BackupError(f"{path} is not encrypted, yet a passphrase was given: leave "
                          "--passphrase-file out, or check that this is the backup you meant")
    return data


def _not_a_backup(path: Path, data: bytes) -> str:
    head = data[:len(ENCRYPTED)]
    if not data:
        return f"{path} is empty: it is not a backup (a copy that did not happen?); use another"
    changed = sum(a != b for a, b in zip(head, ENCRYPTED, strict=False))
    if len(head) == len(ENCRYPTED) and changed <= 4:
        return (f"{path}'s first line, which marks an encrypted backup, is damaged ({head!r} "
                f"where {ENCRYPTED!r} belongs): the file was changed since it was made; "
                "use another copy")
    return (f"{path} is not an llmgw backup: it starts neither as an encrypted one nor as a "
            "gzip file; check the file name, or use another copy (`llmgw backup --out FILE` "
            "makes one)")


def _unseal(path: Path, data: bytes, passphrase: bytes) -> bytes:
    head = len(ENCRYPTED)
    least = head + _SALT + _NONCE + _TAG
    if len(data) < least:
        raise BackupError(f"{path} is cut short: {len(data)} bytes, where an encrypted backup "
                          f"has {least} at least (a copy that did not finish?); copy it "
                          "again, or use another copy")
    salt, nonce = data[head:head + _SALT], data[head + _SALT:head + _SALT + _NONCE]
    try:
        return AESGCM(_key(passphrase, salt)).decrypt(
            nonce, data[head + _SALT + _NONCE:], ENCRYPTED)
    except InvalidTag:
        raise BackupError(f"the passphrase does not open {path}, or the file was changed "
                          "since it was made (cut short, or a byte changed); check the "
                          "passphrase file, or use another copy") from None


def _gunzip(path: Path, archive: bytes) -> bytes:
    """The tar in archive, read to the end so gzip's checksum and length are checked."""
    try:
        return gzip.decompress(archive)
    except EOFError:
        raise BackupError(f"{path} is cut short: its compressed data stops before gzip's "
                          "end marker (a copy that did not finish?); copy it again, or use "
                          "another copy") from None
    except (OSError, zlib.error) as e:
        raise BackupError(f"{path} is damaged ({e}): the file was changed since it was "
                          "made; use another copy") from None


def _members(path: Path, tar_bytes: bytes) -> dict[str, bytes]:
    try:
        with tarfile.open(fileobj=io.BytesIO(tar_bytes), mode="r:") as tar:
            return {m.name: _member(tar, m) for m in tar.getmembers() if m.isfile()}
    except (tarfile.TarError, OSError, EOFError) as e:
        raise BackupError(f"{path} is not an llmgw backup, or is damaged ({e}); "
                          "`llmgw backup --out FILE` makes one") from None


def _member(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    found = tar.extractfile(member)
    assert found is not None
    return found.read()


def _verify(path: Path, backup: Backup) -> None:
    from llmgw.store.copy import Copy

    rows = Copy(backup.store.get("revision", ""), backup.store.get("rows", {}))
    if rows.digests() != backup.manifest.get("digests"):
        raise BackupError(f"{path}: the store's rows do not match the digests the backup "
                          "was made with; the file was changed or damaged: use another copy")
    lacking = [name for name, _, _, needed in FILES if needed and name not in backup.files]
    if lacking:
        raise BackupError(f"{path} lacks {', '.join(lacking)}: it cannot make a control "
                          "plane; use a backup made by `llmgw backup`")


# --- restoring one ---

def restore(backup: Backup, layout: Layout, store_url: str = "") -> list[str]:
    """Make layout's machine the control plane backup was of; the lines to print. Refused,
    with nothing written, where this machine already has a cluster CA or a server.yaml."""
    from llmgw.store import SchemaError, Store, StoreError, refusal
    from llmgw.store.copy import Copy, CopyError, write_verified

    mode = backup.manifest.get("mode")
    if mode != layout.mode:
        raise BackupError(f"the backup is of a {mode}-mode host; restore it in {mode} mode "
                          f"(--mode {mode}), not {layout.mode}")
    present = [str(p) for p in (layout.ca_cert, layout.ca_key, layout.server_yaml) if p.exists()]
    if present:
        raise BackupError(f"this machine already has {', '.join(present)}: restore makes a "
                          "machine the control plane it was, and never writes over one; "
                          "restore into a new --state-dir, or remove these first")
    text = moved(backup.files["server.yaml"].decode(), backup.manifest.get("root", ""),
                  layout)
    if store_url:
        text = with_store(text, store_url)
    config = load_server_text(text, layout.server_yaml)
    rows = Copy(backup.store["revision"], backup.store["rows"])
    nothing = "; nothing was restored"
    try:
        store = Store(config.store_at())
    except (SchemaError, OSError) as e:
        raise BackupError(f"cannot open the store to restore into: {e}{nothing}") from None
    except StoreError as e:
        raise BackupError(refusal(e, config.store_at()) + nothing) from None
    try:
        write_verified(store, rows)
    except CopyError as e:
        raise BackupError(str(e)) from None
    except StoreError as e:
        raise BackupError(f"cannot write the store: {refusal(e, config.store_at())}{nothing}") \
            from None
    finally:
        store.close()
    for name, attr, loosest, _ in FILES:
        if name in backup.files:
            body = text.encode() if name == "server.yaml" else backup.files[name]
            try:
                atomic_write(getattr(layout, attr), body,
                             mode=_restored_mode(backup.manifest, name, loosest))
            except OSError as e:
                raise BackupError(f"cannot write {getattr(layout, attr)}: {e.strerror or e}; "
                                  f"make {layout.etc} writable, remove what was restored "
                                  "there and into the store, and run again") from None
    counts = backup.manifest.get("counts", {})
    made = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(backup.manifest.get("created", 0)))
    return [
        f"restored the control plane backed up on {backup.manifest.get('host')} at {made}: "
        f"{counts.get('nodes', 0)} nodes, {counts.get('models', 0)} models, "
        f"{counts.get('keys', 0)} keys in {store.path}",
        f"its CA, certificates, admin credential and server.yaml are in {layout.etc}",
        "next: `pytest provision/"
        + (f" --state-dir {layout.root}" if layout.root else "")
        + "` starts it (add --no-node, --no-mirror, --no-starter as on the first host); "
          "nodes reconnect by themselves",
    ]


def _restored_mode(manifest: dict[str, Any], name: str, loosest: int) -> int:
    """name's mode when it was backed up, never looser than loosest (loosest itself for a
    backup made before modes were kept)."""
    modes = manifest.get("modes")
    found = modes.get(name) if isinstance(modes, dict) else None
    return found & loosest if isinstance(found, int) else loosest


def moved(text: str, old_root: str, layout: Layout) -> str:
    """server.yaml with a local-mode host's paths moved from its old state dir to this."""
    if not old_root or layout.root is None or old_root == str(layout.root):
        return text
    return re.sub(re.escape(old_root) + r"(?=[/'\"\s]|$)", str(layout.root), text,
                  flags=re.MULTILINE)


def with_store(text: str, url: str) -> str:
    """server.yaml with its top-level `store:` set to url."""
    line = f"store: {json.dumps(url)}"
    if re.search(r"^store:.*$", text, flags=re.MULTILINE):
        return re.sub(r"^store:.*$", line, text, count=1, flags=re.MULTILINE)
    return text.rstrip("\n") + "\n" + line + "\n"


def load_server_text(text: str, where: Path) -> ServerConfig:
    """server.yaml's text as the configuration it is (a ConfigError as a BackupError)."""
    try:
        return parse(ServerConfig, yaml.safe_load(text), f"the backup's server.yaml (as {where})")
    except (ConfigError, yaml.YAMLError) as e:
        raise BackupError(f"{e}; the backup cannot be restored as it is") from None
