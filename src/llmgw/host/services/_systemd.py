"""systemd units: written only when their text differs, the old one kept as .bak."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

from llmgw.host.changes import Mkdir, Run, WriteFile
from llmgw.host.commands import CommandFailed, run_logged
from llmgw.host.services import OPEN_FILES, Action, Planned, ServiceError, ServiceSpec, drift

UNIT_DIR = Path("/etc/systemd/system")


def render_unit(spec: ServiceSpec) -> str:
    env = [f"Environment={shlex.quote(f'{k}={v}')}" for k, v in sorted(spec.environment.items())]
    limits = [] if any(line.startswith("LimitNOFILE=") for line in spec.systemd_service) else [
        f"LimitNOFILE={OPEN_FILES}"]
    # The socket unit holds the listener; the service takes it from systemd at start.
    socket = [f"Requires={spec.name}.socket", f"After={spec.name}.socket"] if spec.socket else []
    lines = [
        "[Unit]",
        f"Description={spec.description}",
        "After=network-online.target",
        "Wants=network-online.target",
        *socket,
        "",
        "[Service]",
        "# Written by llmgw; an edited copy is kept beside it as .bak when llmgw rewrites it.",
        f"ExecStart={shlex.join(spec.command)}",
        *env,
        *([f"EnvironmentFile=-{spec.environment_file}"] if spec.environment_file else []),
        *spec.systemd_service,
        *limits,
        "",
        "[Install]",
        "WantedBy=multi-user.target",
        "",
    ]
    return "\n".join(lines)


def render_socket(spec: ServiceSpec) -> str:
    """NAME.socket for a spec with socket lines: the listener systemd holds for NAME.service."""
    return "\n".join([
        "[Unit]",
        f"Description={spec.description} (its listening socket)",
        "",
        "[Socket]",
        "# Written by llmgw. Connections wait in this socket's backlog while the service",
        "# restarts; the service takes the socket from systemd ($LISTEN_FDS).",
        *spec.socket,
        "",
        "[Install]",
        "WantedBy=sockets.target",
        "",
    ])


class Systemd(Planned):
    """Services as systemd units in /etc/systemd/system."""

    def __init__(self, unit_dir: Path = UNIT_DIR) -> None:
        self.unit_dir = unit_dir

    def definition_path(self, name: str) -> Path:
        return self.unit_dir / f"{name}.service"

    def _systemctl(self, *args: str) -> None:
        try:  # systemd keeps the log: the journal
            run_logged(["systemctl", *args], what=f"systemctl {' '.join(args)}",
                       where=f"see `journalctl -u {args[-1]}`")
        except CommandFailed as e:
            raise ServiceError(str(e)) from None

    def socket_path(self, name: str) -> Path:
        return self.unit_dir / f"{name}.socket"

    def definition_drift(self, spec: ServiceSpec) -> str:
        found = drift(self.definition_path(spec.name), render_unit(spec))
        if found or not spec.socket:
            return found
        return drift(self.socket_path(spec.name), render_socket(spec))

    def write_unit(self, spec: ServiceSpec) -> bool:
        """The service's unit and, with socket lines, its socket unit; whether either
        changed."""
        writes = self._unit_writes(spec)
        for write in writes:
            self._do(write)
        return bool(writes)

    def _unit_writes(self, spec: ServiceSpec) -> list[Action]:
        """The unit files whose text differs from what spec renders to (socket first)."""
        wanted = [(self.socket_path(spec.name), render_socket(spec))] if spec.socket else []
        wanted.append((self.definition_path(spec.name), render_unit(spec)))
        writes: list[Action] = []
        for path, text in wanted:
            try:
                old: str | None = path.read_text()
            except FileNotFoundError:
                old = None
            if old != text:
                backup = path.with_name(path.name + ".bak") if old is not None else None
                writes.append(WriteFile(path, text, backup=backup))
        return writes

    def plan_ensure(self, spec: ServiceSpec) -> list[Action]:
        return self._plan_ensure(spec)[0]

    def _plan_ensure(self, spec: ServiceSpec) -> tuple[list[Action], bool]:
        """The actions of ensure(spec), and whether the service runs now."""
        writes = self._unit_writes(spec)
        changed, running = bool(writes), self.is_running(spec.name)
        actions = [*writes, *([_systemctl("daemon-reload")] if changed else [])]
        if spec.socket:
            actions.append(_systemctl("enable", "--now", f"{spec.name}.socket"))
        actions.append(_systemctl("enable", "--now", spec.name))
        if changed and running and spec.socket:
            # A changed address needs the socket bound again, which only a stopped service
            # lets happen: this restart refuses connections for a moment.
            actions += [_systemctl("stop", spec.name),
                        _systemctl("restart", f"{spec.name}.socket"),
                        _systemctl("start", spec.name)]
        elif changed and running:
            actions.append(_systemctl("restart", spec.name))
        return actions, running

    def ensure(self, spec: ServiceSpec) -> bool:
        actions, running = self._plan_ensure(spec)
        self._do_all(actions)
        return any(isinstance(a, WriteFile) for a in actions) or not running

    def plan_restart(self, name: str) -> list[Action]:
        return [_systemctl("restart", name)]

    def plan_reload(self, name: str) -> list[Action]:
        return [_systemctl("restart", name)]

    def _do(self, action: Action) -> None:
        if isinstance(action, WriteFile | Mkdir):
            action.apply()
        else:
            self._systemctl(*action.argv[1:])

    def is_running(self, name: str) -> bool:
        proc = subprocess.run(["systemctl", "is-active", "--quiet", name])
        return proc.returncode == 0

    def not_enabled(self, spec: ServiceSpec) -> str:
        units = [f"{spec.name}.socket"] if spec.socket else []
        for unit in [*units, spec.name]:
            proc = subprocess.run(["systemctl", "is-enabled", unit], capture_output=True,
                                  text=True)
            if proc.returncode != 0:
                return f"{unit} is {proc.stdout.strip() or 'not enabled'} under systemd"
        return ""

    def describe(self, name: str) -> str:
        proc = subprocess.run(["systemctl", "is-active", name], capture_output=True, text=True)
        return f"{name} is {proc.stdout.strip() or 'unknown'} under systemd"

    def start_hint(self, name: str) -> str:
        return f"systemctl start {name} (its log: journalctl -u {name})"


def _systemctl(*args: str) -> Run:
    return Run(("systemctl", *args))
