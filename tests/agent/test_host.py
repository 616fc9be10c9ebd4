"""The management interface: the one holding the address this node reaches the control plane
from, on this machine's real interfaces and inside network namespaces."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw.agent import host
from llmgw.host import netaddr


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


def _can_make_netns() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def netns() -> Iterator[str]:
    """Function: a network namespace with veth pairs mgmt0/peer0 (10.203.0.2/24) and
    data0/peer1 (10.204.0.2/24), and no eth0 at all; removed afterwards."""
    if not _can_make_netns():
        pytest.skip("network namespaces need root and the ip command")
    name = f"llmgw-test-{uuid.uuid4().hex[:8]}"
    try:
        _ip("netns", "add", name)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot create a network namespace here: {e.stderr.decode().strip()}")
    try:
        _ip("-n", name, "link", "add", "mgmt0", "type", "veth", "peer", "name", "peer0")
        _ip("-n", name, "link", "add", "data0", "type", "veth", "peer", "name", "peer1")
        _ip("-n", name, "addr", "add", "10.203.0.2/24", "dev", "mgmt0")
        _ip("-n", name, "addr", "add", "10.204.0.2/24", "dev", "data0")
        for link in ("lo", "mgmt0", "peer0", "data0", "peer1"):
            _ip("-n", name, "link", "set", link, "up")
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)


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
