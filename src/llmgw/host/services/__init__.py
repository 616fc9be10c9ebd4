"""Service managers behind one small interface: systemd in system mode, supervisord in local."""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from llmgw.errors import Error
from llmgw.host.changes import Mkdir, Run, WriteFile

__all__ = [
    "HARDENING",
    "OPEN_FILES",
    "Action",
    "ServiceError",
    "ServiceManager",
    "ServiceSpec",
    "llmgw_command",
    "read_environment_file",
]


# Open files a service may hold: the agent API keeps a connection (a socket) per node,
# and 5,000 nodes do not fit the usual default of 1,024.
OPEN_FILES = 65536


# The [Service] lines every llmgw unit that runs as user llmgw shares: no new privileges,
# a read-only system, no home folders, a private /tmp.
HARDENING = ("NoNewPrivileges=true", "ProtectSystem=strict", "ProtectHome=true",
             "PrivateTmp=true")


class ServiceError(Error):
    """A service could not be defined, started or read back."""


@dataclass(frozen=True)
class ServiceSpec:
    """One long-running process: what runs it and, under systemd, how it is confined."""

    name: str
    description: str
    command: list[str]
    # Lines for the [Service] section of a systemd unit, in order; local mode ignores them.
    systemd_service: list[str] = field(default_factory=list)
    environment: dict[str, str] = field(default_factory=dict)
    # systemd only: a root-only file of KEY=VALUE lines read at start, for secrets that
    # must not be in the unit text (every user can read units). Optional: "-" prefixed.
    environment_file: str = ""
    # systemd only: lines for the [Socket] section of NAME.socket, which holds the listening
    # socket across restarts of the service (socket activation, $LISTEN_FDS); none: no
    # socket unit.
    socket: list[str] = field(default_factory=list)
    # How long a stop may take before the process is killed (a drain needs its bound).
    stop_timeout_s: float = 15.0


# One thing a manager does to the host, of llmgw.host.changes' one set; plan_* lists them,
# ensure/restart/reload do them: a file (a unit, a program section, PATH.bak kept where it
# replaces one), a folder, and a command as the argv a person would type (systemctl's own,
# or the supervisorctl line that does what the supervisor does over its XML-RPC socket).
Action = WriteFile | Mkdir | Run


class Planned:
    """What both managers share: restart and reload do exactly what their plans list."""

    def _do(self, action: Action) -> None:
        raise NotImplementedError

    def plan_restart(self, name: str) -> list[Action]:
        raise NotImplementedError

    def plan_reload(self, name: str) -> list[Action]:
        raise NotImplementedError

    def _do_all(self, actions: list[Action]) -> None:
        for action in actions:
            self._do(action)

    def restart(self, name: str) -> None:
        self._do_all(self.plan_restart(name))

    def reload(self, name: str) -> None:
        self._do_all(self.plan_reload(name))


class ServiceManager(Protocol):
    def definition_path(self, name: str) -> Path:
        """Where the service's definition (unit or program section) lives."""

    def ensure(self, spec: ServiceSpec) -> bool:
        """Define, enable and start the service; restart it when its definition changed.
        Does exactly plan_ensure(spec)'s actions, in order, then waits for it to run.

        Returns whether anything changed.
        """

    def plan_ensure(self, spec: ServiceSpec) -> list[Action]:
        """What ensure(spec) would do now, read only: the files it would write, the folders
        it would make, the commands it would run."""

    def plan_restart(self, name: str) -> list[Action]:
        """What restart(name) would do now, read only."""

    def plan_reload(self, name: str) -> list[Action]:
        """What reload(name) would do now, read only."""

    def definition_drift(self, spec: ServiceSpec) -> str:
        """Why the service's definition is not what spec renders to; '' when it is."""

    def is_running(self, name: str) -> bool: ...

    def not_enabled(self, spec: ServiceSpec) -> str:
        """Why the service would not come back by itself after a reboot; '' when it
        would."""

    def restart(self, name: str) -> None:
        """Stop the service if it runs, then start it."""

    def reload(self, name: str) -> None:
        """Move the service to a fresh process without refusing a connection: SIGHUP under
        supervisord (the gateway's master hands its socket to a new worker); a restart
        under systemd, whose socket unit holds the connections meanwhile."""

    def describe(self, name: str) -> str:
        """A line on the service's state, for messages."""

    def start_hint(self, name: str) -> str:
        """The command a person runs to start the service."""


def drift(path: Path, text: str) -> str:
    """Why the file at path does not hold text; '' when it does (read only)."""
    try:
        if path.read_text() == text:
            return ""
    except FileNotFoundError:
        return f"there is no {path}"
    return f"{path} differs from what this llmgw writes"


def llmgw_command(*args: str, mode: str = "local") -> list[str]:
    """The argv that runs `llmgw ARGS`: in system mode the installed llmgw (/opt/llmgw,
    linked from /usr/local/bin), which every service user can run; in local mode this
    very installation."""
    if mode == "system":
        from llmgw.host.install import LINK

        return [str(LINK), *args]
    script = Path(sys.executable).parent / "llmgw"
    if script.exists():
        return [str(script), *args]
    found = shutil.which("llmgw")
    if found:
        return [found, *args]
    return [sys.executable, "-m", "llmgw", *args]


def render_environment_file(env: dict[str, str]) -> str:
    """env as systemd EnvironmentFile lines: values double-quoted, quotes and backslashes
    escaped."""
    def quoted(value: str) -> str:
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'

    return "".join(f"{k}={quoted(v)}\n" for k, v in sorted(env.items()))


def read_environment_file(path: Path) -> dict[str, str]:
    """The KEY="VALUE" lines render_environment_file wrote; {} when there is no file.

    For local mode, where supervisord has no EnvironmentFile: the service reads it itself."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    env: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        key, sep, value = line.partition("=")
        if not line.strip() or line.startswith("#"):
            continue
        if not (sep and key.isidentifier()):
            raise ServiceError(f"{path} line {number} is not KEY=VALUE ({line[:40]!r}); "
                               "remove it, or run `pytest provision/` to write the file again")
        env[key] = _unquoted(value)
    return env


def _unquoted(value: str) -> str:
    if len(value) < 2 or not (value.startswith('"') and value.endswith('"')):
        return value
    out: list[str] = []
    chars = iter(value[1:-1])
    for c in chars:
        out.append(next(chars, "") if c == "\\" else c)
    return "".join(out)
