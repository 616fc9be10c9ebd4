"""server.yaml and agent.yaml: load, check and render (YAML through safe_load only)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from llmgw.errors import Error


class ConfigError(Error):
    """A configuration file is missing, unreadable or holds a wrong value."""


@dataclass
class TLSFiles:
    ca: str = ""
    cert: str = ""
    key: str = ""


@dataclass
class MirrorRef:
    """Where the control plane finds the model mirror's management API; listen is set
    only when the mirror runs on this machine (its bytes server's bind address)."""

    api: str = ""
    listen: str = ""
    # The bytes server's URL as nodes reach it (http://ADDR:PORT); told to every node in
    # its heartbeat answer, so a node needs no server.yaml to find the mirror.
    url: str = ""


@dataclass
class ServerConfig:
    """server.yaml: the control plane's listen addresses, state and certificates."""

    admin_listen: str = "127.0.0.1:9090"
    agent_listen: str = ":7443"
    gateway_listen: str = ":8080"
    state_dir: str = "/var/lib/llmgw"
    # The address nodes use to reach the agent API; first --advertise name.
    advertise: str = ""
    tls: TLSFiles = field(default_factory=TLSFiles)
    # The CA key signs joining nodes' CSRs and the revocation list; "" means ca-key.pem
    # beside tls.ca.
    ca_key: str = ""
    node_timeout_s: float = 30.0
    tokens: list[str] = field(default_factory=list)
    mirror: MirrorRef = field(default_factory=MirrorRef)


@dataclass
class EngineConfig:
    """How the agent finds or builds llama.cpp."""

    llama_server: str = ""
    cache_dir: str = ""
    source: str = ""
    version: str = ""


@dataclass
class AgentConfig:
    """agent.yaml: this node's control plane, identity files and labels."""

    server: str = "https://127.0.0.1:7443"
    node_id: str = ""
    state_dir: str = "/var/lib/llmgw-agent"
    tls: TLSFiles = field(default_factory=TLSFiles)
    labels: dict[str, str] = field(default_factory=dict)
    heartbeat_s: float = 5.0
    # Renew the node's certificate (a CSR over mTLS) when it expires within this many days.
    renew_before_days: float = 30.0
    engine: EngineConfig = field(default_factory=EngineConfig)


def parse_listen(addr: str) -> tuple[str, int]:
    """':7443' → ('0.0.0.0', 7443); '127.0.0.1:9090' → ('127.0.0.1', 9090); '[::1]:80' too."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"listen address {addr!r} has no port; write HOST:PORT or :PORT")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)


def connect_host(addr: str) -> str:
    """The HOST:PORT a client on this machine uses to reach a listen address."""
    host, port = parse_listen(addr)
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _build(cls: type, data: Any, where: str) -> Any:
    if data is None:
        return cls()
    if not isinstance(data, dict):
        raise ConfigError(f"{where} should be a mapping, found {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"{where} has unknown keys {', '.join(unknown)}; known: {', '.join(fields)}"
        )
    values: dict[str, Any] = {}
    for name, value in data.items():
        kind = fields[name].type
        if dataclasses.is_dataclass(globals().get(str(kind))):
            values[name] = _build(globals()[str(kind)], value, f"{where}.{name}")
        else:
            values[name] = _coerce(kind, value, f"{where}.{name}")
    return cls(**values)


def _coerce(kind: Any, value: Any, where: str) -> Any:
    expected = {"str": str, "float": (int, float), "list[str]": list, "dict[str, str]": dict}
    want = expected.get(str(kind))
    if want is not None and not isinstance(value, want):
        raise ConfigError(f"{where} should be {kind}, found {value!r}")
    if str(kind) == "float":
        return float(value)
    if str(kind) == "dict[str, str]":
        return {str(k): str(v) for k, v in value.items()}
    return value


def _load(cls: type, path: str | os.PathLike[str]) -> Any:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist; run `pytest provision/` to write it") from None
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from e
    return _build(cls, data, path.name)


def load_server(path: str | os.PathLike[str]) -> ServerConfig:
    return _load(ServerConfig, path)


def load_agent(path: str | os.PathLike[str]) -> AgentConfig:
    return _load(AgentConfig, path)


def render(config: ServerConfig | AgentConfig, header: str, omit: tuple[str, ...] = ()) -> str:
    """YAML text for a config, with a comment header saying who wrote it; omit leaves keys out."""
    data = {k: v for k, v in dataclasses.asdict(config).items() if k not in omit}
    body = yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    return comment + body
