"""A throwaway network namespace for the management-interface tests: veth pairs mgmt0/peer0
and data0/peer1, the addresses asked for, and no eth0 at all; removed afterwards, whatever
the test did. Traffic stays inside it."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextmanager
def namespace(mgmt: tuple[str, ...], data: str) -> Iterator[str]:
    """A namespace whose mgmt0 holds the CIDRs of mgmt, in that order, and data0 holds data;
    yields its name. Skips the test where namespaces cannot be made (not root, no iproute2)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and the ip command (iproute2)")
    name = f"llmgw-if-{uuid.uuid4().hex[:8]}"
    try:
        ip("netns", "add", name)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot create a network namespace here: {e.stderr.decode().strip()}")
    try:
        ip("-n", name, "link", "add", "mgmt0", "type", "veth", "peer", "name", "peer0")
        ip("-n", name, "link", "add", "data0", "type", "veth", "peer", "name", "peer1")
        for cidr in mgmt:
            ip("-n", name, "addr", "add", cidr, "dev", "mgmt0")
        ip("-n", name, "addr", "add", data, "dev", "data0")
        for link in ("lo", "mgmt0", "peer0", "data0", "peer1"):
            ip("-n", name, "link", "set", link, "up")
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)
