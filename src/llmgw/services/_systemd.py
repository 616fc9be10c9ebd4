"""systemd units: written only when their text differs, the old one kept as .bak."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

from llmgw._files import atomic_write
from llmgw.services import OPEN_FILES, ServiceError, ServiceSpec, drift

UNIT_DIR = Path("/etc/systemd/system")


def render_unit(spec: ServiceSpec) -> str:
    env = [f"Environment={shlex.quote(f'{k}={v}')}" for k, v in sorted(spec.environment.items())]
    limits = [] if any(line.startswith("LimitNOFILE=") for line in spec.systemd_service) else [
        f"LimitNOFILE={OPEN_FILES}"]
    lines = [
        "[Unit]",
        f"Description={spec.description}",
        "After=network-online.target",
        "Wants=network-online.target",
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


class Systemd:
    """Services as systemd units in /etc/systemd/system."""

    def __init__(self, unit_dir: Path = UNIT_DIR) -> None:
        self.unit_dir = unit_dir

    def definition_path(self, name: str) -> Path:
        return self.unit_dir / f"{name}.service"

    def _systemctl(self, *args: str) -> str:
        proc = subprocess.run(["systemctl", *args], capture_output=True, text=True)
        if proc.returncode != 0:
            raise ServiceError(
                f"systemctl {' '.join(args)} failed ({proc.returncode}): "
                f"{(proc.stderr or proc.stdout).strip()}; see `journalctl -u {args[-1]}`"
            )
        return proc.stdout

    def definition_drift(self, spec: ServiceSpec) -> str:
        return drift(self.definition_path(spec.name), render_unit(spec))

    def write_unit(self, spec: ServiceSpec) -> bool:
        path = self.definition_path(spec.name)
        text = render_unit(spec)
        try:
            old = path.read_text()
        except FileNotFoundError:
            old = None
        if old == text:
            return False
        if old is not None:
            atomic_write(path.with_name(path.name + ".bak"), old)
        atomic_write(path, text)
        return True

    def ensure(self, spec: ServiceSpec) -> bool:
        changed = self.write_unit(spec)
        if changed:
            self._systemctl("daemon-reload")
        running = self.is_running(spec.name)
        self._systemctl("enable", "--now", spec.name)
        if changed and running:
            self._systemctl("restart", spec.name)
        return changed or not running

    def restart(self, name: str) -> None:
        self._systemctl("restart", name)

    def is_running(self, name: str) -> bool:
        proc = subprocess.run(["systemctl", "is-active", "--quiet", name])
        return proc.returncode == 0

    def describe(self, name: str) -> str:
        proc = subprocess.run(["systemctl", "is-active", name], capture_output=True, text=True)
        return f"{name} is {proc.stdout.strip() or 'unknown'} under systemd"

    def start_hint(self, name: str) -> str:
        return f"systemctl start {name} (its log: journalctl -u {name})"
