"""The one way the day-2 commands reach the control plane: the admin API named by the
host's server.yaml (found by --mode and --state-dir, as pytest provision/ finds it)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

from llmgw.cli.clients import admin_client
from llmgw.config import ConfigError, ServerConfig, load_server
from llmgw.control.client import AdminClient
from llmgw.errors import Error, Unreachable, shown_url
from llmgw.host.layout import Layout

T = TypeVar("T")

# Exit codes: 1 the control plane refused the request (an Error), 3 it cannot be reached or
# found.
EXIT_UNREACHABLE = 3


def add_host_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mode", default="auto", choices=("auto", "system", "local"),
                        help="where the host's files live (default auto, as pytest provision/)")
    parser.add_argument("--state-dir", default=None,
                        help="a local-mode host's state dir (as pytest --state-dir)")


def server_config(layout: Layout) -> ServerConfig:
    """The server.yaml of the host layout is; Unreachable (exit 3) where there is none, for
    the commands that work on the control plane's files (backup, store migrate, token)."""
    try:
        return load_server(layout.server_yaml)
    except ConfigError as e:
        raise Unreachable(f"no control plane here: {e}; pass --state-dir (and --mode) of "
                          "a provisioned host") from None


def admin(args: argparse.Namespace) -> AdminClient:
    """The admin API client of the host args name; every day-2 command gets it here."""
    layout = Layout.for_mode(args.mode, args.state_dir)
    try:
        return admin_client(layout)
    except ConfigError as e:
        raise Unreachable(f"no control plane here: {e}; pass --state-dir (and --mode) of "
                          "a provisioned host") from None


def unreachable(client: AdminClient, e: Error) -> Unreachable:
    return Unreachable(f"the control plane does not answer at {shown_url(client.base_url)}: "
                       f"{e}; is it running? `pytest provision/` starts it, `pytest checks/` "
                       "says what is wrong")


def call(client: AdminClient, do: Callable[[], T]) -> T:
    """do()'s answer; a control plane that does not answer at all is Unreachable (the
    command's exit status says so), any other error goes on as it is."""
    try:
        return do()
    except Error as e:
        if getattr(e, "status", 0) is None:
            raise unreachable(client, e) from None
        raise
