"""The management interface: the one holding the address this node reaches the control plane
from, on this machine's real interfaces and inside network namespaces."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw.agent import host
from llmgw.host import netaddr
from tests.agent.netns import namespace


def test_loopback_control_plane_is_reached_over_lo() -> None:
    assert host.management_interface("https://127.0.0.1:7443") == ("lo", "127.0.0.1")


def test_each_local_address_is_reached_over_the_interface_holding_it() -> None:
    """Towards each of this machine's own addresses, the source is that address."""
    checked = 0
    for name, addrs in netaddr.interface_addresses().items():
        for addr in addrs:
            if addr.version == 4 and not addr.is_loopback:
                # The kernel routes to a local address over lo, but its source is the address.
                _, source = host.management_interface(f"https://{addr}:7443")
                assert source == str(addr)
                assert netaddr.interface_holding(source) == name
                checked += 1
    if not checked:
        pytest.skip("this machine has no non-loopback IPv4 address")


def test_unreachable_control_plane_falls_back_to_eth0() -> None:
    assert host.management_interface("https://no-such-host.invalid:7443") == ("eth0", "")


def test_memory_and_cpus_are_read() -> None:
    assert host.cpus() >= 1
    assert host.memory_mb() > 0


@pytest.fixture
def netns() -> Iterator[str]:
    """Function: a network namespace with mgmt0 on 10.203.0.2/24 and data0 on 10.204.0.2/24,
    and no eth0 at all (tests/agent/netns.py)."""
    with namespace(("10.203.0.2/24",), "10.204.0.2/24") as name:
        yield name


def _interface_in(ns: str, server: str) -> str:
    code = (
        "from llmgw.agent.host import management_interface as m; "
        f"print(*m({server!r}))"
    )
    proc = subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, "-c", code],
        check=True, capture_output=True, text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    return proc.stdout.strip()


def test_interface_found_inside_a_network_namespace(netns: str) -> None:
    """A node on mgmt0 and data0 (no eth0): each control plane is reached over its own."""
    assert _interface_in(netns, "https://10.203.0.1:7443") == "mgmt0 10.203.0.2"
    assert _interface_in(netns, "https://10.204.0.9:7443") == "data0 10.204.0.2"


def test_no_route_inside_a_namespace_is_eth0_the_last_resort(netns: str) -> None:
    assert _interface_in(netns, "https://192.0.2.1:7443") == "eth0"
