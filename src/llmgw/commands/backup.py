"""`llmgw backup`, `llmgw restore` and `llmgw store migrate`: the control plane's state
kept in a file, brought back on a new machine, or moved to another backend."""

from __future__ import annotations

import argparse
import socket
import time
from pathlib import Path

from llmgw import backup
from llmgw._files import atomic_write
from llmgw.commands import _admin
from llmgw.config import ConfigError, ServerConfig, connect_host, load_server, parse_listen
from llmgw.errors import Error
from llmgw.layout import Layout


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
    manifest = backup.make(_layout(args), args.out, passphrase)
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
    from llmgw.control.store import SchemaError, Store, StoreError, store_url
    from llmgw.control.store.copy import CopyError, read, write_verified

    layout = _layout(args)
    try:
        config = load_server(layout.server_yaml)
    except ConfigError as e:
        raise _admin.Unreachable(f"no control plane here: {e}") from None
    try:
        target_url = store_url(args.to)
    except ValueError as e:
        raise Error(str(e)) from None
    if store_url(config.store_at()) == target_url:
        raise Error(f"the store is already {args.to}")
    running = _running(config)
    if running:
        raise Error(f"{running} still runs and writes the store: what it wrote after the "
                    "copy would be lost. Stop it first (`llmgw down`, which keeps every "
                    "file), run this again, then `pytest provision/` starts it on the new store")
    try:
        source = Store(config.store_at(), migrate=False)
        target = Store(args.to)
    except (SchemaError, StoreError) as e:
        raise Error(f"cannot open the stores: {e}") from None
    try:
        copied = read(source)
        write_verified(target, copied)
    except CopyError as e:
        raise Error(f"{e}; server.yaml still names the old store") from None
    except StoreError as e:
        raise Error(f"the move failed, nothing changed in server.yaml: {e}") from None
    finally:
        source.close()
        target.close()
    old = layout.server_yaml.with_name(f"server.yaml.before-store-migrate-{int(time.time())}")
    text = layout.server_yaml.read_text()
    atomic_write(old, text, mode=0o644)
    atomic_write(layout.server_yaml, backup.with_store(text, args.to), mode=0o644)
    counts = copied.counts()
    print(f"moved {sum(counts.values())} rows from {source.path} to {target.path}: "
          + ", ".join(f"{name} {n}" for name, n in counts.items()))
    print("every table's row count and sha256 digest are equal in both")
    print(f"server.yaml now names the new store (the old file kept as {old.name}); "
          "`pytest provision/` starts the control plane and the gateway on it")
    return 0


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
