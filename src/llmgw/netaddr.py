"""This machine's network interfaces and addresses, read from the kernel."""

from __future__ import annotations

import fcntl
import ipaddress
import random
import socket
import struct
from pathlib import Path

_SIOCGIFADDR = 0x8915

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def _ipv4_of(name: str) -> ipaddress.IPv4Address | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        except OSError:
            return None
    return ipaddress.IPv4Address(packed[20:24])


def _ipv6_by_interface(if_inet6: Path = Path("/proc/net/if_inet6")) -> dict[str, list[IPAddress]]:
    found: dict[str, list[IPAddress]] = {}
    try:
        lines = if_inet6.read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        fields = line.split()
        if len(fields) < 6:
            continue
        addr = ipaddress.IPv6Address(int(fields[0], 16))
        found.setdefault(fields[5], []).append(addr)
    return found


def interface_addresses() -> dict[str, list[IPAddress]]:
    """Every interface's addresses: IPv4 first, then IPv6 (link-local left out)."""
    v6 = _ipv6_by_interface()
    result: dict[str, list[IPAddress]] = {}
    for _, name in socket.if_nameindex():
        addrs: list[IPAddress] = []
        v4 = _ipv4_of(name)
        if v4 is not None:
            addrs.append(v4)
        addrs.extend(a for a in v6.get(name, []) if not a.is_link_local)
        result[name] = addrs
    return result


def local_addresses() -> list[IPAddress]:
    """This machine's addresses, loopback last, each once."""
    seen: list[IPAddress] = []
    for addrs in interface_addresses().values():
        seen.extend(a for a in addrs if a not in seen)
    return sorted(seen, key=lambda a: (a.is_loopback, a.version))


def interface_holding(address: str) -> str | None:
    """The name of the interface that holds address, or None."""
    wanted = ipaddress.ip_address(address)
    for name, addrs in interface_addresses().items():
        if wanted in addrs:
            return name
    return None


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_PICK = 10000
_handed_out: set[int] = set()


def ephemeral_ports(source: Path = EPHEMERAL_RANGE) -> range:
    """The ports the kernel gives outgoing connections (Linux's default when unreadable)."""
    try:
        low, high = (int(n) for n in source.read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing is bound to at host right now, outside the ephemeral range.

    The kernel's own pick (bind to port 0) comes from the range it also gives outgoing
    connections: between the pick and the listener's bind, any connection may take the
    port as its source and the bind fails (EADDRINUSE). A port below the range is only
    ever taken by another bind. Each port is handed out once per process."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    ephemeral = ephemeral_ports()
    outside = range(_LOWEST_PICK, ephemeral.start) if ephemeral.start > _LOWEST_PICK + 1000 \
        else range(ephemeral.stop, 65536)
    for _ in range(64):
        port = random.choice(outside)
        if port in _handed_out:
            continue
        with socket.socket(family) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket(family) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def source_address_towards(host: str, port: int) -> str:
    """The local address the kernel picks to reach host:port (UDP connect sends nothing)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]
