"""This machine's network interfaces and addresses, read from the kernel; HOST:PORT joined."""

from __future__ import annotations

import ipaddress
import os
import random
import socket
import struct
from pathlib import Path

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# rtnetlink (linux/rtnetlink.h, linux/if_addr.h): one dump of every address, as `ip addr`
# and Go's net.InterfaceAddrs read them. SIOCGIFADDR, which this replaced, answers one IPv4
# address per interface (its primary), so an interface that reaches the control plane
# through its second address was not found to hold it.
_RTM_NEWADDR, _RTM_GETADDR = 20, 22
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_IFA_ADDRESS, _IFA_LOCAL = 1, 2
_NLMSGHDR = struct.Struct("=IHHII")   # length, type, flags, seq, pid
_IFADDRMSG = struct.Struct("=BBBBI")  # family, prefixlen, flags, scope, interface index
_RTATTR = struct.Struct("=HH")        # length, type


def join_host_port(host: str, port: int | str) -> str:
    """HOST:PORT as a listen address or a URL writes it: an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _align(n: int) -> int:
    return (n + 3) & ~3


def _addresses_of(message: bytes) -> tuple[int, IPAddress] | None:
    """(interface index, address) of one RTM_NEWADDR message's payload."""
    family, _, _, _, index = _IFADDRMSG.unpack_from(message)
    attrs: dict[int, bytes] = {}
    at = _align(_IFADDRMSG.size)
    while at + _RTATTR.size <= len(message):
        length, kind = _RTATTR.unpack_from(message, at)
        if length < _RTATTR.size:
            break
        attrs[kind] = message[at + _RTATTR.size:at + length]
        at += _align(length)
    # IFA_LOCAL is the address itself; IFA_ADDRESS is the peer's on a point-to-point link
    # and the address itself elsewhere (and for IPv6).
    raw = attrs.get(_IFA_LOCAL) or attrs.get(_IFA_ADDRESS)
    if raw is None:
        return None
    if family == socket.AF_INET and len(raw) == 4:
        return index, ipaddress.IPv4Address(raw)
    if family == socket.AF_INET6 and len(raw) == 16:
        return index, ipaddress.IPv6Address(raw)
    return None


def _netlink_addresses() -> list[tuple[int, IPAddress]]:
    """Every address of every interface, (interface index, address), in the kernel's order
    (an interface's primary address before its secondaries); OSError when netlink fails."""
    found: list[tuple[int, IPAddress]] = []
    seq = random.randrange(1, 1 << 31)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as s:
        s.bind((0, 0))
        request = _IFADDRMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0)
        s.sendall(_NLMSGHDR.pack(_NLMSGHDR.size + len(request), _RTM_GETADDR,
                                 _NLM_F_REQUEST | _NLM_F_DUMP, seq, 0) + request)
        while True:
            data = s.recv(1 << 16)
            if not data:
                raise OSError("netlink closed before the address dump ended")
            at = 0
            while at + _NLMSGHDR.size <= len(data):
                length, kind, _, got_seq, _ = _NLMSGHDR.unpack_from(data, at)
                if length < _NLMSGHDR.size:
                    raise OSError(f"netlink sent a message of {length} bytes")
                payload = data[at + _NLMSGHDR.size:at + length]
                at += _align(length)
                if got_seq != seq:
                    continue
                if kind == _NLMSG_DONE:
                    return found
                if kind == _NLMSG_ERROR:
                    (errno,) = struct.unpack_from("=i", payload)
                    if errno:
                        raise OSError(-errno, f"netlink address dump: {os.strerror(-errno)}")
                    continue
                if kind == _RTM_NEWADDR and (entry := _addresses_of(payload)) is not None:
                    found.append(entry)


def interface_addresses() -> dict[str, list[IPAddress]]:
    """Every interface's addresses, each of them (an interface may hold several): IPv4
    first, then IPv6 (link-local left out)."""
    names = dict(socket.if_nameindex())
    result: dict[str, list[IPAddress]] = {name: [] for name in names.values()}
    for index, addr in _netlink_addresses():
        name = names.get(index)
        if name is None:  # an interface that came after the list was read
            try:
                name = socket.if_indextoname(index)
            except OSError:
                continue
            result.setdefault(name, [])
        if addr.version == 6 and addr.is_link_local:
            continue
        if addr not in result[name]:
            result[name].append(addr)
    return {name: sorted(addrs, key=lambda a: a.version) for name, addrs in result.items()}


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
