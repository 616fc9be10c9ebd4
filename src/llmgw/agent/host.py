"""Facts about this machine the agent reports: CPUs, memory, its management interface."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit

from llmgw.host import netaddr

LAST_RESORT_INTERFACE = "eth0"


def cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def memory_mb(meminfo: Path = Path("/proc/meminfo")) -> int:
    """Total memory in MiB, 0 when the kernel does not say."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def server_host_port(server_url: str) -> tuple[str, int]:
    parts = urlsplit(server_url)
    return parts.hostname or "127.0.0.1", parts.port or 443


def management_interface(server_url: str, named: str = "") -> tuple[str, str]:
    """(interface, address) this node reaches the control plane from.

    The interface is the one holding the source address the kernel picks towards the
    control plane, whichever of its addresses that is; `eth0` only when that cannot be
    found (no route, a name that does not resolve), with an empty address. named
    (agent.yaml's `interface:`, checked when it is loaded) is the interface instead; the
    address stays the one the control plane is reached from, where engines listen.
    """
    host, port = server_host_port(server_url)
    try:
        addr = netaddr.source_address_towards(host, port)
    except OSError:
        return named or LAST_RESORT_INTERFACE, ""
    # An IPv6 source address may carry a scope (%eth0) the interface table does not.
    addr = addr.split("%", 1)[0]
    return named or netaddr.interface_holding(addr) or LAST_RESORT_INTERFACE, addr
