"""The processes on this machine and what each has used, read from /proc: the CPU figures of
the benches and the fleet tests, and the tests that look for a host's processes."""

from __future__ import annotations

import os
from pathlib import Path


def processes() -> list[tuple[int, list[bytes]]]:
    """Every process now on this machine with its argv, from /proc; one that ends while it is
    read is left out (a scan of /proc races every process that exits meanwhile)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        found.append((int(proc.name), argv))
    return found


def cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def listener_pid(port: int) -> int:
    """The process listening on a local TCP port, from /proc (0 when none is visible)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                return int(proc.name)
        except OSError:
            continue
    return 0
