"""server.yaml and agent.yaml: typed models that refuse a bad value when the file is loaded.

YAML is read with safe_load only. A wrong value is refused naming the file, the key, the
value and what is allowed, so it never surfaces later as a 500 from a running service.
"""

from __future__ import annotations

import os
import socket
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from llmgw.contract.explain import problems
from llmgw.errors import Error
from llmgw.host.netaddr import join_host_port
from llmgw.http1.limits import Limits

M = TypeVar("M", bound=BaseModel)


class ConfigError(Error):
    """A configuration file is missing, unreadable or holds a wrong value."""


class _Section(BaseModel):
    # Unknown keys are refused: a misspelt key would otherwise be silently ignored.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _listen(value: str) -> str:
    try:
        parse_listen(value)
    except ConfigError as e:
        raise ValueError(str(e)) from None
    return value


class TLSFiles(_Section):
    ca: StrictStr = ""
    cert: StrictStr = ""
    key: StrictStr = ""


class GatewayTLS(_Section):
    cert: StrictStr = ""
    key: StrictStr = ""

    @model_validator(mode="after")
    def _both(self) -> GatewayTLS:
        if bool(self.key) != bool(self.cert):
            raise ValueError("gateway_tls needs both cert and key (neither for plain HTTP)")
        return self


class MirrorRef(_Section):
    """Where the control plane finds the model mirror's management API; listen is set
    only when the mirror runs on this machine (its bytes server's bind address)."""

    api: StrictStr = ""
    listen: StrictStr = ""
    # The bytes server's URL as nodes reach it (http://ADDR:PORT); told to every node in
    # its heartbeat answer, so a node needs no server.yaml to find the mirror.
    url: StrictStr = ""


# The model mirror's listen addresses by default (it has no yaml of its own: `llmgw mirror
# serve --listen/--api-listen`): its bytes server for every node, its API on loopback.
MIRROR_LISTEN = ":8081"
MIRROR_API_LISTEN = "127.0.0.1:8082"
# `llmgw check --serve`'s address when provisioning runs it (--check-serve): loopback, for
# its /healthz says why a promise fails. Beside the admin API (9090) and the gateway's
# metrics (9091), and clear of what a monitored host already runs: the exporters' range
# from 9100 (the node exporter), Kafka (9092), Alertmanager (9093, 9094), Loki's and
# Mimir's gRPC (9095, 9096), and the Prometheus docs/operations.md puts on 9099.
CHECK_LISTEN = "127.0.0.1:9097"
# Seconds between two rounds of `llmgw check --serve` (each a fresh `llmgw check`).
CHECK_INTERVAL_S = 60.0


# Longer than any heartbeat interval, so a kept-alive agent never finds its connection gone.
AGENT_KEEP_ALIVE_S = 120.0
# The agent API's limits unless server.yaml's agent_http says otherwise: an idle agent's
# connection is kept open (it heartbeats every few seconds over it), and its bodies (join
# requests, heartbeats, drift reports) are small JSON.
AGENT_LIMITS = Limits(keep_alive_s=AGENT_KEEP_ALIVE_S, max_body_bytes=4 << 20)


def _agent_http(value: Any) -> Any:
    """agent_http as given, over the agent API's defaults (AGENT_LIMITS) rather than the
    core's."""
    return asdict(AGENT_LIMITS) | value if isinstance(value, dict) else value


class ServerConfig(_Section):
    """server.yaml: the control plane's listen addresses, state and certificates."""

    admin_listen: StrictStr = "127.0.0.1:9090"
    agent_listen: StrictStr = ":7443"
    gateway_listen: StrictStr = ":8080"
    state_dir: StrictStr = "/var/lib/llmgw"
    # Where the fleet's state is kept: "" is SQLite in STATE_DIR/control.db (nothing to
    # install); postgresql://USER[:PASSWORD]@HOST:PORT/DB is a PostgreSQL database, which
    # several control planes share (docs/operations.md "Moving to PostgreSQL").
    store: StrictStr = ""
    # The address nodes use to reach the agent API; first --advertise name.
    advertise: StrictStr = ""
    tls: TLSFiles = Field(default_factory=TLSFiles)
    # The CA key signs joining nodes' CSRs and the revocation list; "" means ca-key.pem
    # beside tls.ca.
    ca_key: StrictStr = ""
    node_timeout_s: float = Field(default=30.0, gt=0)
    # Bearer tokens of the gateway; a number in YAML (`- 12345`) is refused: quote it.
    tokens: list[StrictStr] = Field(default_factory=list)
    # "required": every gateway request needs a key (`llmgw keys create`) or a token above;
    # "" (a server.yaml from before keys): open to anyone unless tokens are listed.
    gateway_keys: Literal["", "required"] = ""
    # The gateway serves HTTPS with this certificate (chain, leaf first) and key; both ""
    # is plain HTTP. `pytest provision/ --gateway-tls` names the server certificate.
    gateway_tls: GatewayTLS = Field(default_factory=lambda: GatewayTLS())
    # The admin token's sha256 file; '' means admin-token.sha256 beside server.yaml.
    admin_token_hash: StrictStr = ""
    mirror: MirrorRef = Field(default_factory=MirrorRef)
    # The gateway: its request body limit and how long it waits on a replica.
    gateway_max_body_bytes: int = Field(default=16 * 1024 * 1024, gt=0)
    upstream_connect_timeout_s: float = Field(default=5.0, gt=0)
    upstream_read_timeout_s: float = Field(default=600.0, gt=0)
    # How the gateway picks a replica: balanced (least in flight within each replica's
    # slots, conversations kept on the replica holding their prompt cache) or round-robin;
    # beyond every replica's slots a request waits, at most queue_wait_s behind queue_size
    # others (per model), then is answered 503 with Retry-After.
    gateway_routing: Literal["balanced", "round-robin"] = "balanced"
    gateway_queue_size: int = Field(default=256, ge=0)
    gateway_queue_wait_s: float = Field(default=30.0, gt=0)
    # A request for a model with no ready replica (scaling.min 0, or all gone) waits for
    # one to load at most load_wait_s, behind at most load_queue_size others (per model).
    load_wait_s: float = Field(default=120.0, gt=0)
    load_queue_size: int = Field(default=256, ge=0)
    # The gateway's own process (`llmgw gateway`): its metrics on a loopback listener, which
    # the admin API's /metrics appends, and how long a stop lets requests under way finish.
    gateway_metrics_listen: StrictStr = "127.0.0.1:9091"
    gateway_drain_s: float = Field(default=30.0, gt=0, le=600)
    # What one client may send the gateway and the agent API, and how slowly (`Limits`,
    # read as it is). The gateway's body limit on the wire is gateway_max_body_bytes plus
    # its framing unless gateway_http.max_body_bytes says otherwise.
    gateway_http: Limits = Field(default_factory=Limits)
    agent_http: Annotated[Limits, BeforeValidator(_agent_http)] = Field(
        default_factory=lambda: AGENT_LIMITS)

    @field_validator("admin_listen", "agent_listen", "gateway_listen", "gateway_metrics_listen")
    @classmethod
    def _has_port(cls, value: str) -> str:
        return _listen(value)

    @field_validator("store")
    @classmethod
    def _a_store(cls, value: str) -> str:
        if value and not value.startswith(STORE_SCHEMES) and not value.startswith("/"):
            raise ValueError(f"{value!r} is neither an absolute path (a SQLite file) nor a "
                             "postgresql://USER@HOST:PORT/DB URL; leave it out for SQLite in "
                             "state_dir")
        return value

    def store_at(self) -> str:
        """Where the store is: `store`, else the SQLite file in state_dir."""
        return self.store or str(Path(self.state_dir) / "control.db")


# What engine.prebuilt and engine.cuda take (the harness's --engine-prebuilt, --engine-cuda).
EnginePrebuilt = Literal["off", "auto", "xllamacpp"]
EngineCuda = Literal["auto", "off"]


def _off(value: Any) -> Any:
    # YAML reads `cuda: off`, as the docs and the GPU engine's failure tell a person to
    # write it, as false: it means "off" (any other value is checked as written).
    return "off" if value is False else value


class EngineConfig(_Section):
    """How the agent finds or builds llama.cpp."""

    llama_server: StrictStr = ""
    cache_dir: StrictStr = ""
    source: StrictStr = ""
    # A string: `version: 0.3` in YAML is a number, refused (quote it).
    version: StrictStr = ""
    # off: find or build llama-server; xllamacpp: its prebuilt CPU wheel first; auto: the
    # wheel on a CPU node without a cached build (see llmgw.agent.engines.cpu). Provisioning
    # writes auto (--engine-prebuilt); the library's own default builds.
    prebuilt: Annotated[EnginePrebuilt, BeforeValidator(_off)] = "off"
    # auto: on a node with NVIDIA GPUs, make llama.cpp with CUDA (llamacpp-cuda) in the
    # background while the CPU engine serves; off: CPU only (tests and CI write off).
    cuda: Annotated[EngineCuda, BeforeValidator(_off)] = "auto"
    # A llama-server built with CUDA to use as llamacpp-cuda instead of building one; it
    # is checked like a built one (--list-devices names each GPU).
    cuda_server: StrictStr = ""


def _labels(value: Any) -> Any:
    # Label values are strings on the wire; YAML makes `true` and `2` other types.
    if isinstance(value, dict):
        return {str(k): v if isinstance(v, (dict, list)) else str(v) for k, v in value.items()}
    return value


class AgentConfig(_Section):
    """agent.yaml: this node's control plane, identity files and labels."""

    server: StrictStr = "https://127.0.0.1:7443"
    node_id: StrictStr = ""
    state_dir: StrictStr = "/var/lib/llmgw-agent"
    tls: TLSFiles = Field(default_factory=TLSFiles)
    labels: Annotated[dict[StrictStr, StrictStr], BeforeValidator(_labels)] = Field(
        default_factory=dict)
    heartbeat_s: float = Field(default=5.0, gt=0)
    # How long a call to the control plane may take, connecting and answering, before the
    # agent moves to the next control plane it knows: well under the node timeout (30 s),
    # since a frozen control plane still accepts TCP connections and never answers.
    failover_timeout_s: float = Field(default=5.0, gt=0)
    # Renew the node's certificate (a CSR over mTLS) when it expires within this many days.
    renew_before_days: float = Field(default=30.0, gt=0)
    # The management interface: NCCL and Gloo bootstrap over it (NCCL_SOCKET_IFNAME and
    # GLOO_SOCKET_IFNAME, unless set for the agent) and the heartbeat reports it. "" finds
    # it: the interface holding the address this node reaches the control plane from.
    # load_agent refuses a name this machine has no interface of.
    interface: StrictStr = ""
    engine: EngineConfig = Field(default_factory=EngineConfig)

    @field_validator("interface")
    @classmethod
    def _an_interface_name(cls, value: str) -> str:
        # The kernel's rule (dev_valid_name): under 16 bytes, no '/', ':' or whitespace.
        if value and (len(value.encode()) > 15 or value in (".", "..")
                      or any(c in value for c in "/: \t\n")):
            raise ValueError(f"{value!r} cannot be an interface name (at most 15 characters, "
                             "no '/', ':' or spaces); write one `ip link` lists")
        return value


# What `store` may start with, beside an absolute path.
STORE_SCHEMES = ("postgresql://", "postgres://", "postgresql+psycopg://", "sqlite:///")


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
    return join_host_port(host, port)


def parse(model: type[M], data: Any, where: str) -> M:
    """data (from YAML) as model; ConfigError naming each wrong key, value and what is allowed."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where} should be a mapping of keys to values, found "
                          f"{type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"{where}: {problems(e, model)}. Correct it and run again") from None


def _load(model: type[M], path: str | os.PathLike[str]) -> M:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist; run `pytest provision/` to write it") from None
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from e
    return parse(model, data, str(path))


def load_server(path: str | os.PathLike[str]) -> ServerConfig:
    return _load(ServerConfig, path)


def load_agent(path: str | os.PathLike[str]) -> AgentConfig:
    """agent.yaml, on the machine it is for: an `interface:` this machine does not have is
    refused, naming those it has."""
    agent = _load(AgentConfig, path)
    if agent.interface:
        here = [name for _, name in socket.if_nameindex()]
        if agent.interface not in here:
            raise ConfigError(
                f"{path}: interface is {agent.interface!r}, which this machine does not have "
                f"(its interfaces: {', '.join(here)}); name one of them, or leave `interface:` "
                "out to use the one this node reaches the control plane from. Correct it and "
                "run again")
    return agent


def render(config: ServerConfig | AgentConfig, header: str, omit: tuple[str, ...] = ()) -> str:
    """YAML text for a config, with a comment header saying who wrote it; omit leaves keys out."""
    data = config.model_dump(exclude=set(omit))
    body = yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    return comment + body
