"""A split: two control planes on one PostgreSQL, one of them cut off from it by a real
network fault (its connections go through a loopback TCP proxy the test owns and then
drops). The cut-off one stops scheduling and says so; the other takes the lease once it
lapses; healed, the first writes no placement under its old epoch: no double placement."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from urllib.parse import urlsplit, urlunsplit

import pytest

from llmgw.control.scheduler import Scheduler
from llmgw.store import LeaseLost, Store, StoreError
from tests.control.test_scheduler import PIN, model
from tests.control.test_scheduler_lease import Clock, _leader


class Cable:
    """A loopback TCP proxy to one server: cut() drops every connection through it and
    refuses new ones (a split), mend() listens again on the same port."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.port = 0
        self._listener: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self.mend()

    def mend(self) -> None:
        listener = socket.create_server(("127.0.0.1", self.port))
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        assert self._listener is not None
        with suppress(OSError):  # wakes the accept() under way (close alone would not)
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            with suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                near, _ = listener.accept()
            except OSError:
                return
            far = socket.create_connection(self.target)
            with self._lock:
                self._conns += [near, far]
            for a, b in ((near, far), (far, near)):
                threading.Thread(target=_pipe, args=(a, b), daemon=True).start()


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    with suppress(OSError):
        while data := src.recv(65536):
            dst.sendall(data)
    with suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


@contextmanager
def split_stores(url: str) -> Iterator[tuple[Store, Store, Cable, Clock]]:
    """cp-a's store through a Cable, cp-b's direct, on one clock."""
    parts = urlsplit(url)
    cable = Cable(parts.hostname or "127.0.0.1", parts.port or 5432)
    netloc = parts.netloc.rsplit(":", 1)[0] + f":{cable.port}"
    clock = Clock()
    a = Store(urlunsplit(parts._replace(netloc=netloc)), clock=clock)
    b = Store(url, clock=clock)
    try:
        yield a, b, cable, clock
    finally:
        cable.cut()
        a.close()
        b.close()


def test_a_control_plane_cut_off_from_postgresql_stops_scheduling_and_places_nothing(
        postgres_url, caplog) -> None:
    with split_stores(postgres_url) as (a, b, cable, clock):
        a.record_heartbeat("n1", {"engines": ["llamacpp"], "labels": PIN,
                                  "memory_mb": 16_000})
        a.add_model(model("m"))
        lead_a, lead_b = _leader(a, "cp-a"), _leader(b, "cp-b")
        lease_a = lead_a.step()
        assert lease_a is not None and lead_b.step() is None
        Scheduler(a, node_timeout_s=30).tick(lease_a)
        assert [r["model"] for r in b.replicas()] == ["m"], "control: through the cable"

        cable.cut()
        with caplog.at_level(logging.INFO, logger="llmgw.server"):
            assert lead_a.step() is None and lead_a.lease is None, "it stops scheduling"
        said = [r.getMessage() for r in caplog.records if r.name == "llmgw.server"]
        assert len(said) == 1 and said[0].startswith("not scheduling:"), said
        assert "cannot be reached" in said[0], said
        assert a.reachable().startswith("the store "), "readiness says so too"
        with pytest.raises(StoreError):  # a tick already under way writes nothing
            Scheduler(a, node_timeout_s=30).tick(lease_a)

        clock.now += 9  # within cp-a's lease: cp-b waits for it to lapse
        assert lead_b.step() is None
        clock.now += 2
        b.add_model(model("m2"))
        lease_b = lead_b.step()
        assert lease_b is not None and lease_b.epoch == lease_a.epoch + 1
        Scheduler(b, node_timeout_s=30).tick(lease_b)
        placed = sorted(r["model"] for r in b.replicas())
        assert placed == ["m", "m2"], placed

        cable.mend()  # healed: cp-a goes on with the tick it had under way
        with pytest.raises(LeaseLost, match="cp-b holds it now"):
            Scheduler(a, node_timeout_s=30).tick(lease_a)
        assert lead_a.step() is None, "it sees cp-b's lease and stays off"
        assert sorted(r["model"] for r in a.replicas()) == placed, "no double placement"
