"""The `llmgw` command: every service of a host, and `down` to stop them all."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from llmgw.errors import Error
from llmgw.layout import MODES


def _server(args: argparse.Namespace) -> int:
    from llmgw.config import load_server
    from llmgw.control.server import serve

    asyncio.run(serve(load_server(args.config)))
    return 0


def _mirror_serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    from llmgw.mirror.server import Options, serve

    options = Options(Path(args.dir), args.listen, args.api_listen, args.base or "")
    asyncio.run(serve(options))
    return 0


def _agent(args: argparse.Namespace) -> int:
    from llmgw.agent.agent import run_agent
    from llmgw.config import load_agent

    run_agent(load_agent(args.config))
    return 0


def _down(args: argparse.Namespace) -> int:
    from llmgw.down import down

    for line in down(args.state_dir, args.mode):
        print(line)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmgw", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    server = sub.add_parser("server", help="run the control plane")
    server.add_argument("--config", required=True, help="path to server.yaml")
    server.set_defaults(run=_server)

    mirror = sub.add_parser("mirror", help="the model mirror")
    mirror_sub = mirror.add_subparsers(dest="mirror_command", required=True)
    mserve = mirror_sub.add_parser("serve", help="serve the models dir and download into it")
    mserve.add_argument("--dir", required=True, help="the models dir")
    mserve.add_argument("--listen", default=":8081",
                        help="the bytes server, for every node (default :8081)")
    mserve.add_argument("--api-listen", default="127.0.0.1:8082",
                        help="the management API; keep it on loopback (default 127.0.0.1:8082)")
    mserve.add_argument("--base", default=None, metavar="URL",
                        help="the URL nodes use for the bytes server, http://ADDR:PORT "
                             "(default: the --listen address as seen from here)")
    mserve.set_defaults(run=_mirror_serve)

    agent = sub.add_parser("agent", help="run the node agent")
    agent.add_argument("--config", required=True, help="path to agent.yaml")
    agent.set_defaults(run=_agent)

    down = sub.add_parser("down", help="stop everything the host runs; its data stays")
    down.add_argument("--mode", choices=MODES, default="auto",
                      help="system (systemd units), local (supervisord in --state-dir), or "
                           "auto: system when root and systemd is PID 1")
    down.add_argument("--state-dir", default=None,
                      help="local mode: the host's state dir (default ~/.local/state/llmgw)")
    down.set_defaults(run=_down)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return args.run(args)
    except Error as e:
        print(f"llmgw {args.command}: {e}", file=sys.stderr)
        return 1
