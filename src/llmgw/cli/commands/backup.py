"""`llmgw backup`, `llmgw restore` and `llmgw store migrate`: the control plane's state
kept in a file, brought back on a new machine, or moved to another backend."""

from __future__ import annotations

import argparse
import socket
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING

from llmgw.cli import backup
from llmgw.cli.commands import _admin
from llmgw.config import ServerConfig, connect_host, parse_listen
from llmgw.errors import Error
from llmgw.host.files import atomic_write
from llmgw.host.layout import Layout

if TYPE_CHECKING:
    from llmgw.store.copy import Copy


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    b = sub.add_parser("backup", help="the control plane's CA, credentials, configuration "
                                      "and store in one file (0600)")
    b.add_argument("--out", required=True, type=Path, help="the file to write (never over "
                                                           "an existing one)")
    r = sub.add_parser("restore", help="make this machine the control plane a backup is of")
    r.add_argument("file", type=Path, help="a file `llmgw backup` wrote")
    r.add_argument("--store", default="", metavar="URL",
                   help="restore the store into this backend instead of the backup's "
                        "(postgresql://USER@HOST:PORT/DB, or a SQLite file's path)")
    for p in (b, r):
        p.add_argument("--passphrase-file", default=None, metavar="FILE",
                       help="encrypt (backup) or decrypt (restore) with the passphrase in FILE")
        _admin.add_host_options(p)
    b.set_defaults(run=_backup)
    r.set_defaults(run=_restore)

    s = sub.add_parser("store", help="the control plane's store")
    ssub = s.add_subparsers(dest="store_command", required=True)
    m = ssub.add_parser("migrate", help="move the store to another backend (the control "
                                        "plane and gateway stopped), nothing lost")
    m.add_argument("--to", required=True, metavar="URL",
                   help="an empty PostgreSQL database (postgresql://USER@HOST:PORT/DB) or "
                        "SQLite file")
    _admin.add_host_options(m)
    m.set_defaults(run=_migrate)


def _layout(args: argparse.Namespace) -> Layout:
    return Layout.for_mode(args.mode, args.state_dir)


def _backup(args: argparse.Namespace) -> int:
    passphrase = backup.read_passphrase(args.passphrase_file)
    layout = _layout(args)
    _admin.server_config(layout)  # none here: exit 3, as every day-2 command
    manifest = backup.make(layout, args.out, passphrase)
    counts = manifest["counts"]
    print(f"backed up the control plane to {args.out} (0600"
          f"{', encrypted' if passphrase else ''}): {counts.get('nodes', 0)} nodes, "
          f"{counts.get('models', 0)} models, {counts.get('keys', 0)} keys, "
          f"{len(manifest['files'])} files, store schema {manifest['revision']}")
    if not passphrase:
        print("it holds the CA key and the admin token: keep it where only you can read it, "
              "or make it again with --passphrase-file")
    return 0


def _restore(args: argparse.Namespace) -> int:
    found = backup.load(args.file, backup.read_passphrase(args.passphrase_file))
    for line in backup.restore(found, _layout(args), args.store):
        print(line)
    return 0


def _migrate(args: argparse.Namespace) -> int:
    from llmgw.store import redacted, store_url

    layout = _layout(args)
    config = _admin.server_config(layout)
    try:
        target_url = store_url(args.to)
    except ValueError as e:
        raise Error(str(e)) from None
    if store_url(config.store_at()) == target_url:
        raise Error(f"the store is already {redacted(args.to)}")
    running = _running(config)
    if running:
        raise Error(f"{running} still runs and writes the store: what it wrote after the "
                    "copy would be lost. Stop it first (`llmgw down`, which keeps every "
                    "file), run this again, then `pytest provision/` starts it on the new store")
    copied = _move(config.store_at(), args.to)
    # Kept with server.yaml's mode (and owner), never looser than 0640: it names the store,
    # and a PostgreSQL URL may carry its password.
    mode = stat.S_IMODE(layout.server_yaml.stat().st_mode) & 0o640
    old = layout.server_yaml.with_name(f"server.yaml.before-store-migrate-{int(time.time())}")
    text = layout.server_yaml.read_text()
    try:
        atomic_write(old, text, mode=mode)
        atomic_write(layout.server_yaml, backup.with_store(text, args.to), mode=mode)
    except OSError as e:
        raise Error(f"every row is in {redacted(args.to)}, but {layout.server_yaml} cannot "
                    f"be rewritten ({e.strerror or e}): set `store: URL` in it by hand, "
                    "then `pytest provision/`") from None
    counts = copied.counts()
    print(f"moved {sum(counts.values())} rows from {redacted(config.store_at())} to "
          f"{redacted(args.to)}: " + ", ".join(f"{name} {n}" for name, n in counts.items()))
    print("every table's row count and sha256 digest are equal in both")
    print(f"server.yaml now names the new store (the old file kept as {old.name}); "
          "`pytest provision/` starts the control plane and the gateway on it")
    return 0


def _move(source_at: str, target_at: str) -> Copy:
    """Every row of the store at source_at into the empty one at target_at, read back and
    compared; an Error in one line (server.yaml untouched) when either refuses."""
    from llmgw.store import SchemaError, Store, StoreError, redacted
    from llmgw.store.copy import CopyError, read, write_verified

    kept = f"; nothing changed: server.yaml still names {redacted(source_at)}"
    try:
        source = Store(source_at, migrate=False)
    except (SchemaError, StoreError) as e:
        raise Error(_why(e, source_at) + kept) from None
    try:
        try:
            copied = read(source)
        except StoreError as e:
            raise Error(_why(e, source_at) + kept) from None
        try:
            target = Store(target_at)
        except (SchemaError, StoreError) as e:
            raise Error(_why(e, target_at) + kept) from None
        try:
            write_verified(target, copied)
        except CopyError as e:
            raise Error(f"{e}{kept}") from None
        except StoreError as e:
            raise Error(_why(e, target_at) + kept) from None
        finally:
            target.close()
    finally:
        source.close()
    return copied


def _why(e: Exception, where: str) -> str:
    from llmgw.store import SchemaError, refusal

    return str(e) if isinstance(e, SchemaError) else refusal(e, where)


def _running(config: ServerConfig) -> str:
    """Which of the store's writers answers on this machine, or ''."""
    for what, listen in (("the control plane", config.admin_listen),
                         ("the gateway", config.gateway_metrics_listen)):
        host, port = parse_listen(connect_host(listen))
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return f"{what} ({listen})"
        except OSError:
            continue
    return ""
