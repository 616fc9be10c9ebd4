"""A worker's machine that vanishes without closing anything (its link goes down): the main
node's relay says it lost the worker within the bound its TCP settings give
(rpc_relay.KEEPALIVE_* while idle, rpc_relay.USER_TIMEOUT_MS while it writes), so the agent
fails the split replica. Each side runs in its own network namespace, joined by a veth
pair; nothing leaves them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from tests.agent.cluster_pki import Cluster

pytestmark = pytest.mark.slow

PEER = str(Path(__file__).with_name("relay_peer.py"))
MAIN_ADDR, WORKER_ADDR = "10.201.0.1", "10.201.0.2"
# The bound on a lost worker (the relay's own is 5 s: rpc_relay.USER_TIMEOUT_MS).
LOST_WITHIN_S = 10.0


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextmanager
def _two_machines() -> Iterator[tuple[str, str]]:
    """Namespaces (main, worker) joined by a veth pair: MAIN_ADDR and WORKER_ADDR (/30);
    skips where namespaces cannot be made (not root, no iproute2)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and the ip command (iproute2)")
    tag = uuid.uuid4().hex[:6]
    main, worker = f"llmgw-m-{tag}", f"llmgw-w-{tag}"
    made: list[str] = []
    try:
        for ns in (main, worker):
            try:
                _ip("netns", "add", ns)
            except subprocess.CalledProcessError as e:
                pytest.skip(f"cannot create a network namespace here: {e.stderr.decode()}")
            made.append(ns)
        _ip("link", "add", f"vm{tag}", "netns", main, "type", "veth", "peer", "name",
            f"vw{tag}", "netns", worker)
        for ns, link, addr in ((main, f"vm{tag}", MAIN_ADDR), (worker, f"vw{tag}", WORKER_ADDR)):
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", link)
            _ip("-n", ns, "link", "set", link, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield main, worker
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)


def _peer(stack: ExitStack, ns: str, *args: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, PEER, *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    stack.callback(lambda: (proc.kill(), proc.wait(5)))
    return proc


def _line(proc: subprocess.Popen[str]) -> str:
    __tracebackhide__ = True
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line:
        assert proc.stderr is not None
        proc.kill()
        pytest.fail(f"the relay peer said nothing: {proc.stderr.read()[-2000:]}")
    return line


def _vanish(cluster: Cluster, modes: list[str]) -> list[str]:
    """For each mode (main_peer's MODE, then options), a main and a worker in namespaces
    of their own, a round trip carried; then every worker's link down at once, and what
    each main said."""
    with ExitStack() as stack:
        mains, links = [], []
        for mode in modes:
            main_ns, worker_ns = stack.enter_context(_two_machines())
            w, m = cluster.files["worker-1"], cluster.files["main-1"]
            worker = _peer(stack, worker_ns, "worker", w.ca, w.cert, w.key, WORKER_ADDR,
                           "main-1")
            port = _line(worker)
            main = _peer(stack, main_ns, "main", m.ca, m.cert, m.key, "worker-1",
                         WORKER_ADDR, port, *mode.split())
            assert _line(main) == "carried"
            mains.append(main)
            links.append((worker_ns, "vw" + worker_ns.rsplit("-", 1)[1]))
        for ns, link in links:
            _ip("-n", ns, "link", "set", link, "down")
        for main in mains:
            assert main.stdin is not None
            main.stdin.write("go\n")
            main.stdin.flush()
        return [_line(main) for main in mains]


def test_a_worker_machine_that_vanishes_is_lost_within_the_keepalive_bound(
        cluster: Cluster) -> None:
    """The worker's link down (no FIN, no RST: its machine is gone): an idle carried
    connection is lost within keepalive's bound, one the main engine writes to within
    TCP_USER_TIMEOUT's, both within LOST_WITHIN_S, and the relay says the connection failed
    (timed out; or no route to host, the error the kernel kept from its neighbour lookup
    while retransmitting). Measured here: 3.9 to 4.1 s idle, 5.7 s writing. The control:
    without TCP_USER_TIMEOUT, the connection being written to is not lost within the relay
    peer's wait (12 s): keepalive sends no probe while data is unacknowledged, and the
    kernel retransmits for minutes."""
    idle, write, control = _vanish(cluster, ["idle", "write", "write no-user-timeout"])
    for said in (idle, write):
        assert said.startswith("lost "), said
        seconds = float(said.split()[1])
        assert seconds < LOST_WITHIN_S, said
        assert "its connection failed" in said, said
    assert control == "none", control
