"""The control plane's side of a fleet: join tokens and the line a new machine runs,
and removing a node; both through the loopback admin API, with the admin token."""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass

from llmgw.cli import control_plane_join
from llmgw.cli.clients import admin_client
from llmgw.config import ConfigError, ServerConfig, load_server, parse_listen
from llmgw.host import pki
from llmgw.host.layout import Layout
from llmgw.host.netaddr import join_host_port

_TTL = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_ttl(text: str) -> float:
    """'90s', '15m', '1h', '2d' or plain seconds → seconds."""
    found = _TTL.match(text)
    if not found or float(found.group(1)) <= 0:
        raise ConfigError(f"--ttl {text!r} is not a duration; write 90s, 15m, 1h or 2d")
    return float(found.group(1)) * _UNIT_S[found.group(2)]


def advertised_host(config: ServerConfig) -> str:
    """The name other machines reach this control plane by: the first --advertise name,
    else the server certificate's first name that is not loopback, else the hostname."""
    if config.advertise:
        return config.advertise
    names = sorted(pki.san_names(pki.load_cert(config.tls.cert)))
    for name in names:
        try:
            if not ipaddress.ip_address(name).is_loopback:
                return name
        except ValueError:
            if name != "localhost":
                return name
    return socket.gethostname()


def agent_url(config: ServerConfig) -> str:
    """The URL nodes reach this control plane's agent API at: https://HOST:PORT, HOST the
    advertised name (advertised_host), PORT agent_listen's."""
    host = advertised_host(config)
    _, port = parse_listen(config.agent_listen)
    return f"https://{join_host_port(host, port)}"


def join_line(config: ServerConfig, token: str) -> str:
    """Exactly what the new machine runs."""
    ca_hash = pki.ca_hash(pki.load_cert(config.tls.ca))
    return (f"pytest provision/ --join {agent_url(config)} --token {token} "
            f"--ca-hash {ca_hash}")


@dataclass(frozen=True)
class Token:
    token: str
    expires: float
    line: str


def create_token(layout: Layout, ttl_s: float, control_plane: bool = False) -> Token:
    """A single-use join token from this machine's control plane, and its join line; with
    control_plane, one that makes the new machine another control plane of this fleet (its
    certificate key in the line only: control_plane_join)."""
    config = load_server(layout.server_yaml)
    bundle = key = ""
    if control_plane:
        control_plane_join.shareable(config)
        key = control_plane_join.new_certificate_key()
        bundle = control_plane_join.seal(layout, config, key)
    with admin_client(layout) as client:
        made = client.create_token(ttl_s, bundle)
    line = join_line(config, made["token"])
    if control_plane:
        line += f" --control-plane --certificate-key {key}"
    return Token(made["token"], made["expires"], line)

