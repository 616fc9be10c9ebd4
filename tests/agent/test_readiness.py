"""Readiness tells busy from dead: a slow probe never takes a replica out of ready; a
refused connection does at once, and so do several failed probes in a row."""

from __future__ import annotations

import logging
import socket
import subprocess
import threading
from collections.abc import Iterator

import pytest

from llmgw.agent.replicas.process import Record
from llmgw.agent.replicas.supervisor import PROBE_FAILURES_TO_LEAVE, Replica, ReplicaSupervisor
from llmgw.host.netaddr import free_port


@pytest.fixture
def sup(tmp_path) -> ReplicaSupervisor:
    return ReplicaSupervisor(state_dir=tmp_path, weights_dir=tmp_path / "w",
                             engine=lambda kind: None,
                             bind_host="127.0.0.1", probe_timeout_s=0.3)


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port that accepts connections and never answers: an engine busy with generations."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield s.getsockname()[1]


def ready_replica(port: int) -> Replica:
    return Replica(Record(id="r1", model="m", profile="cpu", source="", sha256="", args=[],
                          port=port), state="ready")


def test_a_busy_engine_stays_ready_until_several_probes_in_a_row_fail(sup, busy_port) -> None:
    r = ready_replica(busy_port)
    outcome, why = sup._health(r.record)
    assert outcome == "slow" and "ReadTimeout" in why
    for _ in range(PROBE_FAILURES_TO_LEAVE - 1):
        sup._probed(r, outcome, why)
        assert r.state == "ready"
    sup._probed(r, outcome, why)
    assert r.state == "starting"
    assert f"{PROBE_FAILURES_TO_LEAVE} health probes in a row failed" in r.err


def test_one_good_probe_resets_the_count(sup) -> None:
    r = ready_replica(1)
    for _ in range(PROBE_FAILURES_TO_LEAVE - 1):
        sup._probed(r, "slow", "timeout")
    sup._probed(r, "ok", "")
    for _ in range(PROBE_FAILURES_TO_LEAVE - 1):
        sup._probed(r, "slow", "timeout")
    assert r.state == "ready"


def test_a_refused_connection_leaves_ready_at_once(sup) -> None:
    r = ready_replica(free_port())
    outcome, why = sup._health(r.record)
    assert outcome == "refused"
    sup._probed(r, outcome, why)
    assert r.state == "starting" and "refused" in r.err


def test_every_state_change_is_logged_with_its_reason_and_counted(sup, caplog) -> None:
    r = ready_replica(1)
    sup.replicas["r1"] = r
    with caplog.at_level(logging.INFO, logger="llmgw.replicas"):
        sup._probed(r, "refused", "127.0.0.1:1 refused the connection")
        sup._probed(r, "ok", "")
        sup._probed(r, "ok", "")
    assert "replica r1: ready -> starting (127.0.0.1:1 refused the connection)" in caplog.text
    assert "replica r1: starting -> ready" in caplog.text
    assert sup.facts()["replica_state_changes"] == {
        "r1": {"model": "m", "to": {"starting": 1, "ready": 1}}}


class HangingEngines:
    """A port whose connections are accepted and never answered, counting how many are
    open at once: engines that hang."""

    def __init__(self) -> None:
        self.server = socket.socket()
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(64)
        self.port = self.server.getsockname()[1]
        self.open_now = self.most_open = 0
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._hold, args=(conn,), daemon=True).start()

    def _hold(self, conn: socket.socket) -> None:
        with self.lock:
            self.open_now += 1
            self.most_open = max(self.most_open, self.open_now)
        with conn:
            while conn.recv(4096):  # until the prober hangs up
                pass
        with self.lock:
            self.open_now -= 1


@pytest.mark.parametrize("count", [3, 1], ids=["three-replicas", "control-one-replica"])
def test_every_replica_is_probed_at_once_so_hung_engines_do_not_add_up(tmp_path, count) -> None:
    """The control: one replica's probe is the only one open."""
    engines = HangingEngines()
    sup = ReplicaSupervisor(state_dir=tmp_path, weights_dir=tmp_path / "w",
                            engine=lambda kind: None,
                            bind_host="127.0.0.1", probe_timeout_s=0.5)
    alive = subprocess.Popen(["sleep", "60"])
    try:
        for i in range(count):
            r = ready_replica(engines.port)
            r.record.id, r.proc = f"r{i}", alive
            sup.replicas[r.record.id] = r
        sup.watch()
    finally:
        alive.kill()
        alive.wait()
        engines.server.close()
    assert engines.most_open == count
    assert all(r.probe_failures == 1 and r.state == "ready" for r in sup.replicas.values())
