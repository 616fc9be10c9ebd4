"""The management interface as an engine gets it, each case inside a network namespace the
test makes: an interface that reaches the control plane through its second IPv4 address,
agent.yaml's `interface:`, NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME set for the agent,
and the locked-memory limit engines inherit."""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agent.netns import ip, namespace

ROOT = Path(__file__).resolve().parents[2]
# mgmt0 holds two IPv4 addresses: the first (primary) one on 10.203.0.0/24, and the one the
# control plane (10.205.0.1) is reached through on 10.205.0.0/24. data0 is another network.
FIRST, SECOND, OTHER = "10.203.0.2", "10.205.0.2", "10.204.0.2"
CONTROL_PLANE = "https://10.205.0.1:7443"


@pytest.fixture
def netns() -> Iterator[str]:
    """Function: a network namespace with mgmt0 holding 10.203.0.2/24 and 10.205.0.2/24, in
    that order, and data0 10.204.0.2/24 (tests/agent/netns.py)."""
    with namespace((f"{FIRST}/24", f"{SECOND}/24"), f"{OTHER}/24") as name:
        yield name


def run_in(ns: str, code: str, env: dict[str, str] | None = None) -> str:
    """What code (Python, this interpreter) prints run inside ns; its stderr on failure."""
    done = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c",
                           textwrap.dedent(code)],
                          capture_output=True, text=True, cwd=ROOT, timeout=60,
                          env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _one_address_read(name: str) -> str:
    """The read netaddr made before: SIOCGIFADDR, one IPv4 address per interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()))
    return str(ipaddress.IPv4Address(packed[20:24]))


def test_an_interface_reached_through_its_second_address_is_the_management_one(
        netns: str) -> None:
    """The control plane is reached from mgmt0's second address: mgmt0 is found, not the
    eth0 of last resort the one-address read led to (the Go original's bug)."""
    found = run_in(netns, f"""
        from llmgw.host import netaddr
        from llmgw.agent.host import management_interface
        print(*management_interface({CONTROL_PLANE!r}))
        print(*netaddr.interface_addresses()["mgmt0"])
    """)
    assert found.splitlines() == [f"mgmt0 {SECOND}", f"{FIRST} {SECOND}"], found
    # Negative control: the old read sees mgmt0's first address only, so no interface held
    # the source address and NCCL and Gloo were pointed at eth0.
    old = run_in(netns, """
        from tests.agent.test_management_interface import _one_address_read
        print(_one_address_read("mgmt0"))
    """)
    assert old == FIRST != SECOND


def test_a_point_to_point_address_is_this_end_not_the_peer(netns: str) -> None:
    """On a peer address (`ip addr add A peer B`), the interface holds A (IFA_LOCAL), not
    its peer B (IFA_ADDRESS there); the control: the peer is routed over that interface."""
    ip("-n", netns, "addr", "add", "10.206.0.2", "peer", "10.206.0.1/32", "dev", "data0")
    found = run_in(netns, """
        from llmgw.host import netaddr
        print(*netaddr.interface_addresses()["data0"])
        print(netaddr.source_address_towards("10.206.0.1", 7443))
    """)
    assert found.splitlines() == [f"{OTHER} 10.206.0.2", "10.206.0.2"], found


def test_agent_yaml_names_the_interface_and_one_this_machine_lacks_is_refused(
        netns: str, tmp_path: Path) -> None:
    """`interface: data0` is what NCCL and Gloo get (the address stays the one the control
    plane is reached from); `interface: eth0`, which the namespace lacks, is refused naming
    the interfaces it has; the control: without `interface:` mgmt0 is found."""
    code = f"""
        from llmgw import config
        from llmgw.agent.host import management_interface
        try:
            agent = config.load_agent({str(tmp_path / "agent.yaml")!r})
        except config.ConfigError as e:
            print("refused:", e)
        else:
            print(*management_interface({CONTROL_PLANE!r}, agent.interface))
    """
    agent_yaml = tmp_path / "agent.yaml"
    agent_yaml.write_text(f"server: {CONTROL_PLANE}\ninterface: data0\n")
    assert run_in(netns, code) == f"data0 {SECOND}"
    agent_yaml.write_text(f"server: {CONTROL_PLANE}\ninterface: eth0\n")
    refused = run_in(netns, code)
    assert refused.startswith(f"refused: {agent_yaml}: interface is 'eth0', which this "
                              "machine does not have (its interfaces: lo, "), refused
    assert "mgmt0" in refused and "data0" in refused
    agent_yaml.write_text(f"server: {CONTROL_PLANE}\n")
    assert run_in(netns, code) == f"mgmt0 {SECOND}", "control: found without interface:"


ENGINE_ENV = f"""
    import logging
    from pathlib import Path
    from llmgw.agent.replicas import process as engine_process
    from llmgw.agent.host import management_interface
    interface, _ = management_interface({CONTROL_PLANE!r})
    env = engine_process.environment({{"CUDA_VISIBLE_DEVICES": ""}}, interface)
    out = Path("{{log}}")
    engine_process.spawn(["sh", "-c", "echo $NCCL_SOCKET_IFNAME $GLOO_SOCKET_IFNAME"], env,
                         out, logging.getLogger("t")).wait()
    print(out.read_text().strip())
"""


def test_a_socket_ifname_set_for_the_agent_is_kept_for_its_engines(
        netns: str, tmp_path: Path) -> None:
    """NCCL_SOCKET_IFNAME=ib0 set for the agent reaches the engine as it is; GLOO, not set,
    gets the management interface (mgmt0); the control: with neither set both are mgmt0."""
    code = ENGINE_ENV.replace("{log}", str(tmp_path / "engine.log"))
    clean = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")}
    env = {**clean, "NCCL_SOCKET_IFNAME": "ib0"}
    done = subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c",
                           textwrap.dedent(code)], capture_output=True, text=True, cwd=ROOT,
                          timeout=60, env=env)
    assert done.stdout.strip() == "ib0 mgmt0", done.stdout + done.stderr
    (tmp_path / "engine.log").unlink()
    done = subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c",
                           textwrap.dedent(code)], capture_output=True, text=True, cwd=ROOT,
                          timeout=60, env=clean)
    assert done.stdout.strip() == "mgmt0 mgmt0", done.stdout + done.stderr


MEMLOCK = """
    import logging, resource, subprocess, sys
    from pathlib import Path
    from llmgw.agent.replicas import process as engine_process
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 << 10, hard))
    probe = ["sh", "-c", "ulimit -l"]
    print("plain", subprocess.run(probe, capture_output=True, text=True).stdout.strip())
    log = Path("{log}")
    for _ in range(2):
        engine_process.spawn(probe, {}, log, logging.getLogger("llmgw.agent")).wait()
    print("engine", *log.read_text().split())
    print("hard", "unlimited" if hard == resource.RLIM_INFINITY else hard // 1024)
"""


def test_engines_get_the_locked_memory_limit_raised_and_why_not_further_is_said_once(
        netns: str, tmp_path: Path) -> None:
    """With RLIMIT_MEMLOCK's soft limit at 64 KiB (local mode sets none), each engine starts
    with it raised: to unlimited where the agent may raise the hard limit, else to the hard
    limit, with one line in the agent's log that says why not further. The control: a
    process started without spawn() keeps 64 KiB."""
    out = run_in(netns, MEMLOCK.replace("{log}", str(tmp_path / "engine.log")))
    lines = out.splitlines()
    assert "plain 64" in lines, out
    hard = next(line.split()[1] for line in lines if line.startswith("hard "))
    said = [line for line in lines if line.startswith("memlock:")]
    assert len(said) == 1, out
    if said[0].startswith("memlock: raised"):
        assert "engine unlimited unlimited" in lines, out
    else:
        assert f"engine {hard} {hard}" in lines, out
        assert "may not raise" in said[0] and "LimitMEMLOCK=infinity" in said[0], said
