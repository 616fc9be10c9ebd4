"""supervisord for local mode: its config in the state dir, driven over its XML-RPC socket."""

from __future__ import annotations

import os
import resource
import shlex
import subprocess
import sys
import xmlrpc.client
from pathlib import Path
from typing import Any

from supervisor.xmlrpc import SupervisorTransport

from llmgw.host.changes import Mkdir, Run, WriteFile
from llmgw.host.files import last_lines
from llmgw.host.layout import Layout
from llmgw.host.services import OPEN_FILES, Action, Planned, ServiceError, ServiceSpec, drift
from llmgw.host.waiting import Probe, wait_until

_START_TIMEOUT_S = 15.0
# What supervisord's own stop adds to its programs' (measured: well under a second).
_STOP_MARGIN_S = 10.0


def _quote_env(env: dict[str, str]) -> str:
    return ",".join(f'{k}="{v}"' for k, v in sorted(env.items()))


class Supervisor(Planned):
    """Programs under one supervisord whose files all live in root."""

    def __init__(self, root: Path) -> None:
        layout = Layout.for_mode("local", root)  # the host's paths are the layout's
        self.root = Path(root)
        self.conf = layout.supervisord_conf
        self.programs = layout.supervisor_programs
        self.socket = layout.supervisor_socket
        self.pidfile = layout.supervisord_pid
        self.logs = layout.logs

    # --- files ---

    def definition_path(self, name: str) -> Path:
        return self.programs / f"{name}.conf"

    def _main_conf(self) -> str:
        return "\n".join(
            [
                "; supervisord for an llmgw host in local mode; written by llmgw.",
                "[unix_http_server]",
                f"file={self.socket}",
                "chmod=0700",
                "",
                "[supervisord]",
                f"logfile={self.logs / 'supervisord.log'}",
                f"pidfile={self.pidfile}",
                f"directory={self.root}",
                "childlogdir=" + str(self.logs),
                # Programs inherit supervisord's open-file limit (it raises its own to this).
                f"minfds={open_files_limit()}",
                "",
                "[rpcinterface:supervisor]",
                "supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface",
                "",
                "[supervisorctl]",
                f"serverurl=unix://{self.socket}",
                "",
                "[include]",
                f"files={self.programs}/*.conf",
                "",
            ]
        )

    def render_program(self, spec: ServiceSpec) -> str:
        lines = [
            f"; {spec.description}; written by llmgw.",
            f"[program:{spec.name}]",
            f"command={shlex.join(spec.command)}",
            "autostart=true",
            "autorestart=true",
            "startsecs=1",
            "startretries=100",
            "stopsignal=TERM",
            f"stopwaitsecs={round(spec.stop_timeout_s)}",
            "redirect_stderr=true",
            f"stdout_logfile={self.logs / (spec.name + '.log')}",
            "stdout_logfile_maxbytes=10MB",
            "stdout_logfile_backups=2",
        ]
        if spec.environment:
            lines.append(f"environment={_quote_env(spec.environment)}")
        return "\n".join(lines) + "\n"

    def definition_drift(self, spec: ServiceSpec) -> str:
        return drift(self.definition_path(spec.name), self.render_program(spec))

    def _write_if_differs(self, path: Path, text: str) -> list[Action]:
        """The write of text to path, or none when path holds it already."""
        try:
            if path.read_text() == text:
                return []
        except FileNotFoundError:
            pass
        return [WriteFile(path, text, mode=0o600)]  # a program's environment may hold a token

    # --- the daemon ---

    def _rpc(self) -> Any:
        transport = SupervisorTransport(None, None, f"unix://{self.socket}")
        return xmlrpc.client.ServerProxy("http://127.0.0.1", transport=transport).supervisor

    def daemon_running(self) -> bool:
        if not self.socket.exists():
            return False
        try:
            return self._rpc().getState()["statename"] == "RUNNING"
        except (OSError, xmlrpc.client.Fault, xmlrpc.client.ProtocolError):
            return False

    def _daemon_argv(self) -> tuple[str, ...]:
        return (sys.executable, "-m", "supervisor.supervisord", "-c", str(self.conf))

    def _ctl(self, *args: str) -> Run:
        """The supervisorctl line that does what this class does over XML-RPC."""
        return Run((sys.executable, "-m", "supervisor.supervisorctl", "-c", str(self.conf),
                    *args))

    def _plan_daemon(self) -> list[Action]:
        actions = self._write_if_differs(self.conf, self._main_conf())
        if self.daemon_running():
            return actions
        folders: list[Action] = [Mkdir(d) for d in (self.logs, self.programs) if not d.is_dir()]
        return [*actions, *folders, Run(self._daemon_argv())]

    def _start_daemon(self) -> None:
        proc = subprocess.run(
            list(self._daemon_argv()),
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
        )
        if proc.returncode != 0:
            raise ServiceError(
                f"supervisord did not start ({proc.returncode}): {proc.stderr.strip()}; "
                f"its log is {self.logs / 'supervisord.log'}"
            )
        wait_until(
            f"supervisord's socket {self.socket} to answer",
            lambda: Probe(self.daemon_running(), f"no answer; see {self.logs / 'supervisord.log'}"),
            timeout_s=_START_TIMEOUT_S, interval_s=0.1,
        )

    def ensure_daemon(self) -> bool:
        actions = self._plan_daemon()
        self._do_all(actions)
        return bool(actions)

    # --- programs ---

    def plan_ensure(self, spec: ServiceSpec) -> list[Action]:
        known = self._info(spec.name) is not None
        program = self._write_if_differs(self.definition_path(spec.name),
                                         self.render_program(spec))
        # `update` stands for reloadConfig and adding (or replacing) the program's group,
        # as supervisord's answer says; it is needed when supervisord has not read the
        # program's section as it will be.
        update = [self._ctl("update", spec.name)] if program or not known else []
        start = [] if self.is_running(spec.name) else [self._ctl("start", spec.name)]
        return [*self._plan_daemon(), *program, *update, *start]

    def ensure(self, spec: ServiceSpec) -> bool:
        actions = self.plan_ensure(spec)
        self._do_all(actions)
        self._wait_running(spec.name)
        return bool(actions)

    def _update(self, name: str) -> None:
        rpc = self._rpc()
        added, modified, _removed = rpc.reloadConfig()[0]
        if name in modified:
            rpc.stopProcessGroup(name)
            rpc.removeProcessGroup(name)
            rpc.addProcessGroup(name)
        elif name in added:
            rpc.addProcessGroup(name)

    def _start(self, name: str) -> None:
        try:
            self._rpc().startProcess(name)
        except xmlrpc.client.Fault as e:
            if "ALREADY_STARTED" not in e.faultString:
                raise ServiceError(
                    f"supervisord could not start {name}: {e.faultString}; "
                    f"its log is {self.logs / (name + '.log')}"
                ) from e

    def _do(self, action: Action) -> None:
        """One action of a plan: its file written, folder made, or command done (over
        XML-RPC for supervisorctl's)."""
        if isinstance(action, WriteFile | Mkdir):
            action.apply()
        elif action.argv == self._daemon_argv():
            self._start_daemon()
        else:  # supervisorctl -c CONF VERB [ARG] NAME
            verb, name = action.argv[5], action.argv[-1]
            {"update": self._update, "start": self._start, "restart": self._restart,
             "signal": self._hup}[verb](name)

    def _wait_running(self, name: str) -> None:
        # A program counts as started only after startsecs; say so only then.
        wait_until(
            f"{name} to reach RUNNING under supervisord",
            lambda: Probe(True, "") if self.is_running(name) else Probe(False, self.describe(name)),
            timeout_s=_START_TIMEOUT_S, interval_s=0.1,
        )

    def _info(self, name: str) -> dict[str, str | int] | None:
        if not self.daemon_running():
            return None
        try:
            return self._rpc().getProcessInfo(name)
        except xmlrpc.client.Fault:
            return None

    def is_running(self, name: str) -> bool:
        info = self._info(name)
        return info is not None and info["statename"] == "RUNNING"

    def not_enabled(self, spec: ServiceSpec) -> str:
        return ""  # every program starts with supervisord (autostart); nothing to enable

    def plan_restart(self, name: str) -> list[Action]:
        return [self._ctl("restart", name)]

    def plan_reload(self, name: str) -> list[Action]:
        if not self.is_running(name):
            return self.plan_restart(name)
        return [self._ctl("signal", "HUP", name)]

    def _restart(self, name: str) -> None:
        rpc = self._rpc()
        try:
            if self.is_running(name):
                rpc.stopProcess(name)
            rpc.startProcess(name)
            self._wait_running(name)
        except xmlrpc.client.Fault as e:
            raise ServiceError(
                f"supervisord could not restart {name}: {e.faultString}; "
                f"its log is {self.logs / (name + '.log')}"
            ) from e

    def _hup(self, name: str) -> None:
        try:
            self._rpc().signalProcess(name, "HUP")
        except xmlrpc.client.Fault as e:
            raise ServiceError(
                f"supervisord could not send SIGHUP to {name}: {e.faultString}; "
                f"its log is {self.logs / (name + '.log')}"
            ) from e

    def pid(self, name: str) -> int | None:
        info = self._info(name)
        return int(info["pid"]) if info and info["pid"] else None

    def describe(self, name: str) -> str:
        if not self.daemon_running():
            return f"supervisord is not running for {self.root}"
        info = self._info(name)
        if info is None:
            return f"{name} is not defined in supervisord ({self.programs})"
        line = f"{name} is {info['statename']} under supervisord"
        if info["description"]:
            line += f" ({info['description']})"
        if info["statename"] != "RUNNING":
            tail = last_lines(self.logs / f"{name}.log", 3)
            if tail:
                line += f"; the end of its log: {tail}"
        return line

    def start_hint(self, name: str) -> str:
        return (
            f"run `pytest provision/ --state-dir {self.root}` to start it, or "
            f"`python -m supervisor.supervisorctl -c {self.conf} start {name}`; "
            f"its log: {self.logs / (name + '.log')}"
        )

    def stop_bound_s(self) -> float:
        """How long a shutdown may take: supervisord stops its programs one at a time, each
        within its stopwaitsecs (the gateway's drain among them), then itself."""
        waits = [int(line.partition("=")[2]) for conf in self.programs.glob("*.conf")
                 for line in conf.read_text().splitlines() if line.startswith("stopwaitsecs=")]
        return sum(waits) + _STOP_MARGIN_S

    def stop_daemon(self, timeout_s: float | None = None) -> bool:
        """Stop every program and supervisord itself; returns whether it was running.
        timeout_s: how long to wait for it to exit (stop_bound_s() when None)."""
        if not self.daemon_running():
            return False
        if timeout_s is None:
            timeout_s = self.stop_bound_s()
        pid = int(self.pidfile.read_text().strip()) if self.pidfile.exists() else None
        self._rpc().shutdown()
        if pid is not None:
            wait_until(
                f"supervisord (pid {pid}) to exit after it was asked to shut down",
                lambda: Probe(not _alive(pid), f"still running; see "
                                               f"{self.logs / 'supervisord.log'} or kill {pid}"),
                timeout_s=timeout_s, interval_s=0.1,
            )
        return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def open_files_limit() -> int:
    """OPEN_FILES, or the hard limit where that is lower: supervisord refuses to start when
    minfds is above what it may set (a container's root may not raise its hard limit)."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return OPEN_FILES if hard == resource.RLIM_INFINITY else min(OPEN_FILES, hard)
