"""The `llmgw` command: every service of a host, and `down` to stop them all."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable

from llmgw import __version__
from llmgw.cli.commands import add_day2
from llmgw.cli.commands._admin import EXIT_UNREACHABLE
from llmgw.config import MIRROR_API_LISTEN, MIRROR_LISTEN
from llmgw.errors import Error, Unreachable
from llmgw.host.layout import MODES


def _server(args: argparse.Namespace) -> int:
    from pathlib import Path

    from llmgw.config import load_server
    from llmgw.control.server import serve
    from llmgw.host.admin_token import server_hash_path
    from llmgw.http1.service import run_service

    config = load_server(args.config)
    token_hash = server_hash_path(Path(args.config), config.admin_token_hash)
    run_service(serve(config, admin_token_hash=token_hash))
    return 0


def _gateway(args: argparse.Namespace) -> int:
    from pathlib import Path

    from llmgw.gateway import dataplane

    if not args.worker:
        return dataplane.run_master(Path(args.config))
    from llmgw.http1.service import run_service

    run_service(dataplane.serve_worker(Path(args.config)))
    return 0


def _mirror_serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    from llmgw.host.services import read_environment_file
    from llmgw.mirror.server import Options, serve

    if args.env_file:  # local mode: supervisord has no EnvironmentFile, so the mirror reads it
        os.environ.update(read_environment_file(Path(args.env_file)))
    options = Options(
        Path(args.dir), args.listen, args.api_listen, args.base or "",
        admin_token_hash=Path(args.admin_token_hash) if args.admin_token_hash else None,
        import_dirs=tuple(Path(d) for d in args.import_dir),
    )
    # asyncio's own loop: the bytes server relies on its loop.sendfile (kernel sendfile).
    asyncio.run(serve(options))
    return 0


def _mirror_import(args: argparse.Namespace) -> int:
    from pathlib import Path

    from llmgw.cli.clients import mirror_client
    from llmgw.host.layout import Layout

    layout = Layout.for_mode("local" if args.state_dir else "auto", args.state_dir)
    with mirror_client(layout, timeout=30.0) as mirror:
        done = mirror.upload(Path(args.file), model=args.model, version=args.version,
                             sha256=args.sha256)
    print(f"{done['model']}/{done['version']} {done['status']['state']}: {done['url']} "
          f"(sha256 {done['status']['sha256']})")
    return 0


def _agent(args: argparse.Namespace) -> int:
    from llmgw.agent.agent import run_agent
    from llmgw.config import load_agent

    run_agent(load_agent(args.config))
    return 0


def _check(args: argparse.Namespace) -> int:
    from llmgw.cli.check import main_args

    return main_args(args)


def _down(args: argparse.Namespace) -> int:
    from llmgw.cli.down import down

    for line in down(args.state_dir, args.mode):
        print(line)
    return 0


def _token_create(args: argparse.Namespace) -> int:
    import datetime as dt

    from llmgw.cli.commands._admin import server_config
    from llmgw.cli.fleet import create_token, parse_ttl
    from llmgw.errors import APIError
    from llmgw.host.layout import Layout

    layout = Layout.for_mode(args.mode, args.state_dir)
    ttl = parse_ttl(args.ttl)
    server_config(layout)  # none here: exit 3, as every day-2 command
    try:
        made = create_token(layout, ttl, control_plane=args.control_plane)
    except APIError as e:
        if e.status is not None:
            raise
        raise Unreachable(f"{e}; is the control plane running? `pytest provision/` starts "
                          "it, `pytest checks/` says what is wrong") from None
    expires = dt.datetime.fromtimestamp(made.expires, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    if args.control_plane:
        print(f"a single-use control-plane token, valid until {expires}. Its certificate key "
              "opens the fleet's CA key and admin credential and is shown only here: send the "
              "line as you would a password. On the new machine run:")
    else:
        print(f"a single-use join token, valid until {expires}; on the new machine run:")
    print(made.line)
    return 0


def _node_rm(args: argparse.Namespace) -> int:
    from llmgw.cli.commands import _admin

    # As every day-2 command: no server.yaml here, or nothing answering at its address,
    # is exit 3 (Unreachable), saying which.
    with _admin.admin(args) as client:
        removed = _admin.call(client, lambda: client.remove_node(args.node_id))
    serials = list(removed["revoked"])
    print(f"removed {args.node_id}: its replicas drain elsewhere and its certificate "
          f"({', '.join(serials) or 'none issued'}) is refused from now on")
    return 0


def _host_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mode", default="auto", choices=("auto", "system", "local"),
                        help="where the host's files are (as for pytest provision/)")
    parser.add_argument("--state-dir", default=None, help="local mode's state dir")


def _process(sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, help: str,
             config: str, run: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
    """The verb of a long-running process: its config file, and what runs it."""
    parser = sub.add_parser(name, help=help)
    parser.add_argument("--config", required=True, help=f"path to {config}")
    parser.set_defaults(run=run)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmgw", description=__doc__)
    parser.add_argument("--version", action="version", version=f"llmgw {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    _process(sub, "server", "run the control plane", "server.yaml", _server)

    gateway = _process(sub, "gateway", "run the OpenAI-compatible gateway (SIGHUP: a new worker "
                       "takes over the socket, the old one drains)", "server.yaml", _gateway)
    gateway.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)

    mirror = sub.add_parser("mirror", help="the model mirror")
    mirror_sub = mirror.add_subparsers(dest="mirror_command", required=True)
    mserve = mirror_sub.add_parser("serve", help="serve the models dir and download into it")
    mserve.add_argument("--dir", required=True, help="the models dir")
    mserve.add_argument("--listen", default=MIRROR_LISTEN,
                        help="the bytes server, for every node (default %(default)s)")
    mserve.add_argument("--api-listen", default=MIRROR_API_LISTEN,
                        help="the management API; keep it on loopback (default %(default)s)")
    mserve.add_argument("--base", default=None, metavar="URL",
                        help="the URL nodes use for the bytes server, http://ADDR:PORT "
                             "(default: the --listen address as seen from here)")
    mserve.add_argument("--admin-token-hash", default=None, metavar="FILE",
                        help="the admin token's sha256 (admin-token.sha256 beside server.yaml); "
                             "without it the management API refuses everything but /health")
    mserve.add_argument("--import-dir", action="append", default=[], metavar="DIR",
                        help="a folder file:// sources may be read from; repeatable; none by "
                             "default (use `llmgw mirror import` to upload a file instead)")
    mserve.add_argument("--env-file", default=None, metavar="FILE",
                        help="KEY=\"VALUE\" lines (HF_ENDPOINT, HF_TOKEN) put in the "
                             "environment at start; a missing file is no error (local mode's "
                             "mirror.env, 0600)")
    mserve.set_defaults(run=_mirror_serve)

    mimport = mirror_sub.add_parser(
        "import", help="upload a local file into this host's mirror (resumable, sha256-checked)")
    mimport.add_argument("file", help="the model file, e.g. model.gguf")
    mimport.add_argument("--model", required=True, help="the model name in the mirror")
    mimport.add_argument("--version", required=True, help="the version in the mirror")
    mimport.add_argument("--sha256", default=None,
                         help="the digest the file must have (default: computed from it)")
    mimport.add_argument("--state-dir", default=None,
                         help="a local-mode host's state dir (default: the system host, or "
                              "~/.local/state/llmgw when not root)")
    mimport.set_defaults(run=_mirror_import)

    _process(sub, "agent", "run the node agent", "agent.yaml", _agent)

    check = sub.add_parser("check", help="verify this host, read only (the promises of "
                                         "`pytest checks/`, without the checkout)")
    check.add_argument("--state-dir", default=None, help="local mode: the host's state dir")
    check.add_argument("--mode", default="auto", choices=("auto", "system", "local"),
                       help="system (root with systemd), local, or auto (default)")
    check.add_argument("--json", action="store_true",
                       help="print one JSON record per promise: {step, promise, status, message}")
    check.add_argument("--serve", default=None, metavar="ADDR",
                       help="keep checking: a round every --interval, the last result on "
                            "http://ADDR/healthz (200, or 503 naming what fails) and /metrics "
                            "(a gauge per promise); on the control plane's machine each round "
                            "also goes to its admin API (`llmgw status` shows the drift)")
    check.add_argument("--interval", type=float, default=60.0, metavar="SECONDS",
                       help="with --serve: seconds from one round's end to the next's start "
                            "(default 60)")
    check.add_argument("--name", default=None, metavar="HOST",
                       help="with --serve: this host's name in the control plane's drift "
                            "(default the hostname)")
    check.add_argument("pytest_args", nargs="*", metavar="PYTEST_ARG",
                       help="more pytest arguments after --, e.g. -- -k pki")
    check.set_defaults(run=_check)

    token = sub.add_parser("token", help="join tokens for new machines")
    token_sub = token.add_subparsers(dest="token_command", required=True)
    create = token_sub.add_parser("create", help="a single-use join token and the join line")
    create.add_argument("--ttl", default="1h", help="how long it is valid (90s, 15m, 1h, 2d)")
    create.add_argument("--control-plane", action="store_true",
                        help="a token that makes the new machine another control plane of "
                             "this fleet (the store must be PostgreSQL); the line carries a "
                             "certificate key, printed only there")
    _host_options(create)
    create.set_defaults(run=_token_create)

    node = sub.add_parser("node", help="the nodes of this control plane")
    node_sub = node.add_subparsers(dest="node_command", required=True)
    rm = node_sub.add_parser("rm", help="remove a node: drain it and refuse its certificate")
    rm.add_argument("node_id")
    _host_options(rm)
    rm.set_defaults(run=_node_rm)

    down = sub.add_parser("down", help="stop everything the host runs; its data stays")
    down.add_argument("--mode", choices=MODES, default="auto",
                      help="system (systemd units), local (supervisord in --state-dir), or "
                           "auto: system when root and systemd is PID 1")
    down.add_argument("--state-dir", default=None,
                      help="local mode: the host's state dir (default ~/.local/state/llmgw)")
    down.set_defaults(run=_down)
    add_day2(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # A line per HTTP request would bury a command's own output and every service's log.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        return args.run(args)
    except Unreachable as e:
        print(f"llmgw {args.command}: {e}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except Error as e:
        print(f"llmgw {args.command}: {e}", file=sys.stderr)
        return 1
