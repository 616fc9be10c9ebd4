"""Clients of a host's management APIs, authenticated with its admin token: the one place
that turns a Layout (a state dir, or the system host) into a working client."""

from __future__ import annotations

from llmgw import config as cfg
from llmgw.control.client import AdminClient
from llmgw.errors import Error
from llmgw.host.admin_token import read_token
from llmgw.host.layout import Layout
from llmgw.mirror import MirrorClient


def admin_client(layout: Layout, *, timeout: float = 10.0) -> AdminClient:
    """The admin API server.yaml names, with the admin token; AdminTokenError names the
    token file when this user cannot read it."""
    server = cfg.load_server(layout.server_yaml)
    url = f"http://{cfg.connect_host(server.admin_listen)}"
    return AdminClient(url, token=read_token(layout.admin_token), timeout=timeout)


def gateway_key(layout: Layout) -> str:
    """The key a client of this host's gateway sends as its bearer token; '' when the
    gateway asks for none. The one place that says which key clients are handed: the
    owner's key provisioning made (etc/gateway-key, 0600: readable by its owner only), else
    server.yaml's first static token."""
    try:
        return layout.gateway_key.read_text().strip()
    except FileNotFoundError:
        pass
    tokens = cfg.load_server(layout.server_yaml).tokens
    return tokens[0] if tokens else ""


def mirror_client(layout: Layout, *, timeout: float = 10.0) -> MirrorClient:
    """The mirror management API server.yaml names, with the admin token."""
    server = cfg.load_server(layout.server_yaml)
    if not server.mirror.api:
        raise Error(f"{layout.server_yaml} names no mirror (mirror.api); provision one with "
                    "`pytest provision/`, or the host was provisioned with --no-mirror")
    return MirrorClient(server.mirror.api, token=read_token(layout.admin_token), timeout=timeout)
