"""Where a host's files live: system mode (root with systemd) or local mode (one state dir)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from llmgw.errors import Error

MODES = ("auto", "system", "local")


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(base) / "llmgw"


def systemd_is_init() -> bool:
    """Whether systemd is PID 1 (its runtime dir exists only then)."""
    return Path("/run/systemd/system").is_dir()


def resolve_mode(mode: str) -> str:
    if mode not in MODES:
        raise Error(f"--mode {mode!r} is not one of {', '.join(MODES)}")
    if mode != "auto":
        return mode
    return "system" if os.geteuid() == 0 and systemd_is_init() else "local"


class _LocalFile:
    """A file of local mode's state dir, read as a Layout's attribute: system mode has no
    such file, and reading it there is an Error."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, layout: Layout | None, owner: type[Layout]) -> Path:
        if layout is None:
            raise AttributeError(f"{self.name} is a host's file: read it on a Layout")
        if layout.root is None:
            raise Error(f"{self.name} exists only in local mode; this host is in "
                        f"{layout.mode} mode")
        return layout.root / self.name


@dataclass(frozen=True)
class Layout:
    """The paths of one host."""

    mode: str
    etc: Path
    models: Path
    server_state: Path
    agent_state: Path
    # Local mode only: supervisord's config, socket and logs.
    root: Path | None = None

    @property
    def pki(self) -> Path:
        return self.etc / "pki"

    @property
    def ca_cert(self) -> Path:
        return self.pki / "ca.pem"

    @property
    def ca_key(self) -> Path:
        return self.pki / "ca-key.pem"

    @property
    def server_cert(self) -> Path:
        return self.pki / "server.pem"

    @property
    def server_key(self) -> Path:
        return self.pki / "server-key.pem"

    @property
    def agent_cert(self) -> Path:
        return self.etc / "agent.pem"

    @property
    def agent_key(self) -> Path:
        return self.etc / "agent-key.pem"

    @property
    def provision_lock(self) -> Path:
        """Held by `pytest provision/` while it works on this host."""
        return (self.root or self.server_state) / "provision.lock"

    @property
    def server_yaml(self) -> Path:
        return self.etc / "server.yaml"

    @property
    def agent_yaml(self) -> Path:
        return self.etc / "agent.yaml"

    @property
    def admin_token(self) -> Path:
        """The admin API's bearer token, the provisioning user's only (0600)."""
        return self.etc / "admin-token"

    @property
    def admin_token_hash(self) -> Path:
        """The token's sha256, which the services (the mirror's user too) can read."""
        return self.etc / "admin-token.sha256"

    @property
    def gateway_key(self) -> Path:
        """The owner's gateway API key, made once by provisioning, the owner's only (0600)."""
        return self.etc / "gateway-key"

    @property
    def check_serve(self) -> Path:
        """`ADDR INTERVAL` of `llmgw check --serve`, as --check-serve first gave them."""
        return self.etc / "check-serve"

    @property
    def mirror_probe(self) -> Path:
        """The mirror's probe file's source: in the models dir (the mirror unit may write
        nowhere else), under a dot-name, which the mirror never serves."""
        return self.models / ".llmgw-probe" / "probe.bin"

    # supervisord's files, in local mode only.
    supervisord_conf = _LocalFile("supervisord.conf")
    supervisor_programs = _LocalFile("supervisor.d")
    supervisor_socket = _LocalFile("supervisor.sock")
    supervisord_pid = _LocalFile("supervisord.pid")

    @property
    def logs(self) -> Path:
        return (self.root / "logs") if self.root else Path("/var/log/llmgw")

    @classmethod
    def for_mode(cls, mode: str, state_dir: str | os.PathLike[str] | None = None) -> Layout:
        mode = resolve_mode(mode)
        if mode == "system":
            return cls(
                mode="system",
                etc=Path("/etc/llmgw"),
                models=Path("/srv/models"),
                server_state=Path("/var/lib/llmgw"),
                agent_state=Path("/var/lib/llmgw-agent"),
            )
        root = Path(state_dir).absolute() if state_dir else default_state_dir()
        return cls(
            mode="local",
            etc=root / "etc",
            models=root / "models",
            server_state=root / "lib" / "llmgw",
            agent_state=root / "lib" / "llmgw-agent",
            root=root,
        )
