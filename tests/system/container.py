"""A booted systemd for system-mode tests: this machine's own root, seen through a
throwaway overlay, booted with systemd-nspawn. It shares the network (so it listens on
this machine's ports) and nothing it writes reaches the real root.

    with SystemdContainer.boot(base) as c:
        c.run("systemctl", "is-system-running")
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

BOOT_TIMEOUT_S = 180.0
POWEROFF_TIMEOUT_S = 60.0
# What a system-mode host listens on; the container shares the network, so these must
# be free here.
DEFAULT_PORTS = (9090, 9091, 7443, 8080, 8081, 8082, 9097)
# A fresh host: none of these may be in the root the overlay starts from.
SYSTEM_PATHS = ("/etc/llmgw", "/srv/models", "/var/lib/llmgw", "/var/lib/llmgw-agent",
                "/opt/llmgw", "/usr/local/bin/llmgw", "/etc/systemd/system/llmgw-server.service")
# The environment of commands run inside: this machine's, less what ties it to the
# pytest and the venv running here, and the hub settings a test gives explicitly.
_DROP_ENV = ("PYTEST_", "VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "COV_", "_PYTEST", "HF_")


class CannotBoot(Exception):
    """This machine cannot boot a systemd container; the message says why (a skip reason)."""


def why_cannot_boot() -> str:
    """Why a systemd container cannot run here; '' when it can."""
    if os.geteuid() != 0:
        return "booting a systemd container needs root (mount, systemd-nspawn)"
    if "overlay" not in Path("/proc/filesystems").read_text():
        return "the kernel has no overlayfs (no `overlay` in /proc/filesystems)"
    if not Path("/lib/systemd/systemd").exists():
        return "systemd is not installed here (/lib/systemd/systemd is missing)"
    if not shutil.which("systemd-nspawn"):
        return "systemd-nspawn is missing: apt-get install systemd-container"
    return ""


def install_nspawn() -> None:
    """apt-get install systemd-container when nspawn is missing and we are root with apt."""
    if shutil.which("systemd-nspawn") or os.geteuid() != 0 or not shutil.which("apt-get"):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "install", "-y", "-qq", "systemd-container"], env=env,
                   capture_output=True, check=False, timeout=600)


def taken_ports(ports: Sequence[int] = DEFAULT_PORTS) -> list[int]:
    """Those of ports that something on this machine already listens on."""
    taken = []
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                taken.append(port)
    return taken


def on_root_filesystem(candidates: Sequence[str] = ("/var/tmp", "/var/lib", "/")) -> Path:
    """A folder on the root filesystem itself: the overlay's lower dir is / without its
    sub-mounts, and upper and work dirs must sit on a filesystem that supports them."""
    root_dev = os.stat("/").st_dev
    for name in candidates:
        if Path(name).is_dir() and os.stat(name).st_dev == root_dev:
            return Path(name)
    raise CannotBoot(f"none of {', '.join(candidates)} is on the root filesystem")


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


@dataclass
class SystemdContainer:
    """A booted container over an overlay of /; run() executes commands inside it."""

    base: Path
    nspawn: subprocess.Popen[bytes] | None = None
    init_pid: int = 0
    boot_s: float = 0.0
    env: dict[str, str] = field(default_factory=dict)

    @property
    def upper(self) -> Path:
        return self.base / "upper"

    @property
    def merged(self) -> Path:
        return self.base / "merged"

    @property
    def console(self) -> Path:
        return self.base / "console.log"

    def path(self, inside: str) -> Path:
        """Where a path inside the container is, seen from this machine."""
        return self.merged / inside.lstrip("/")

    # --- boot ---

    @classmethod
    def prepare(cls, base: Path) -> SystemdContainer:
        """Make the overlay (lower /, upper and work in base) and mount it on base/merged."""
        for name in ("upper", "work", "merged"):
            (base / name).mkdir(parents=True)
        c = cls(base)
        options = f"lowerdir=/,upperdir={base / 'upper'},workdir={base / 'work'}"
        proc = subprocess.run(["mount", "-t", "overlay", "overlay", "-o", options,
                               str(c.merged)], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            shutil.rmtree(base)  # nothing mounted yet
            raise CannotBoot(f"cannot mount an overlay of / on {c.merged}: {proc.stderr.strip()}")
        c.env = {k: v for k, v in os.environ.items() if not k.startswith(_DROP_ENV)}
        c.env["HOME"] = "/root"
        return c

    def start(self) -> None:
        """Boot systemd in the container and wait until it says running (or degraded)."""
        began = time.monotonic()
        with self.console.open("wb") as log:
            self.nspawn = subprocess.Popen(
                ["systemd-nspawn", "-q", "--register=no", "--keep-unit", "-D",
                 str(self.merged), "-b"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        state = self._wait_running(began + BOOT_TIMEOUT_S)
        self.boot_s = time.monotonic() - began
        if state not in ("running", "degraded"):
            raise RuntimeError(
                f"the container's systemd did not come up within {BOOT_TIMEOUT_S:.0f}s "
                f"(is-system-running: {state!r}); its console: {self._console_tail()}"
            )

    def _wait_running(self, deadline: float) -> str:
        state = "no init yet"
        while time.monotonic() < deadline:
            assert self.nspawn is not None
            if self.nspawn.poll() is not None:
                return f"systemd-nspawn exited with {self.nspawn.returncode}"
            if not self.init_pid:
                kids = _children(self.nspawn.pid)
                self.init_pid = kids[0] if kids else 0
            if self.init_pid:
                state = self.run("systemctl", "is-system-running", check=False).stdout.strip()
                if state in ("running", "degraded"):
                    return state
            time.sleep(0.5)
        return state

    def _console_tail(self, n: int = 15) -> str:
        lines = self.console.read_text(errors="replace").splitlines()
        return " | ".join(line.strip() for line in lines[-n:])

    # --- inside ---

    def run(self, *argv: str, cwd: str = "/", check: bool = True, timeout: float = 120,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run argv inside the container (all its namespaces), as root, in cwd."""
        cmd = ["nsenter", "-t", str(self.init_pid), "-a", "env", "-C", cwd, *argv]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env={**self.env, **(env or {})}, check=False)
        if check and proc.returncode != 0:
            raise AssertionError(
                f"inside the container, `{' '.join(argv)}` (in {cwd}) exited "
                f"{proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
            )
        return proc

    def show(self, unit: str, *props: str) -> dict[str, str]:
        """`systemctl show UNIT -p P...` as a dict."""
        out = self.run("systemctl", "show", unit, *(f"-p{p}" for p in props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    # --- teardown ---

    def stop(self) -> str:
        """Power the container off, unmount the overlay, then remove its dirs.

        Returns '' or what could not be cleaned. The merged root is unmounted first and
        never removed recursively while mounted: through it, rm would reach the real /.
        """
        if self.nspawn is not None and self.nspawn.poll() is None:
            if self.init_pid:
                self.run("systemctl", "poweroff", check=False, timeout=30)
            try:
                self.nspawn.wait(POWEROFF_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.nspawn.pid, signal.SIGKILL)
                self.nspawn.wait(30)
        proc = subprocess.run(["umount", str(self.merged)], capture_output=True, text=True,
                              check=False)
        if os.path.ismount(self.merged):
            return (f"{self.merged} is still mounted ({proc.stderr.strip()}); unmount it, "
                    f"then remove {self.base}")
        shutil.rmtree(self.base)
        return ""
