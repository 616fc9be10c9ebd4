"""Several control planes on one store, on both backends: only the scheduler lease's
holder writes placements, a holder frozen past its lease then woken writes nothing under its
old epoch, and an unreachable store stops scheduling without ending the loop."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from llmgw.control.leadership import ID_FILE, Identity, Leadership, control_plane_id
from llmgw.control.scheduler import Scheduler
from llmgw.store import LeaseLost, Store, StoreError
from tests.control.test_scheduler import PIN, model


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["sqlite", "postgresql"])
def two_stores(request: pytest.FixtureRequest,
               tmp_path: Path) -> Iterator[tuple[Store, Store, Clock]]:
    """Function: two control planes' views of one new store (a SQLite file, then a
    PostgreSQL database), on one clock the test drives."""
    where = (str(tmp_path / "control.db") if request.param == "sqlite"
             else request.getfixturevalue("postgres_url"))
    clock = Clock()
    a, b = Store(where, clock=clock), Store(where, clock=clock)
    yield a, b, clock
    a.close()
    b.close()


def _leader(store: Store, name: str) -> Leadership:
    return Leadership(store, Identity(name, f"https://{name}:7443", f"http://{name}:9090",
                                      1000.0), ttl_s=10)


def test_a_frozen_holder_woken_past_its_lease_writes_no_placement(two_stores) -> None:
    a, b, clock = two_stores
    a.record_heartbeat("n1", {"engines": ["llamacpp"], "labels": PIN, "memory_mb": 16_000})
    a.add_model(model("m"))
    lead_a, lead_b = _leader(a, "cp-a"), _leader(b, "cp-b")
    lease_a = lead_a.step()
    assert lease_a is not None and lease_a.epoch == 1
    assert lead_b.step() is None, "cp-a holds it: cp-b does not schedule"
    Scheduler(a, node_timeout_s=30).tick(lease_a)
    assert [r["model"] for r in a.replicas()] == ["m"], "control: the holder writes"

    clock.now += 11  # cp-a is stopped (SIGSTOP) past its lease; cp-b takes over
    lease_b = lead_b.step()
    assert lease_b is not None and lease_b.epoch == 2
    a.add_model(model("m2"))
    before = a.replicas()
    with pytest.raises(LeaseLost, match="cp-b holds it now under epoch 2"):
        Scheduler(a, node_timeout_s=30).tick(lease_a)  # woken, cp-a goes on with its tick
    assert a.replicas() == before, "nothing written under the old epoch"
    Scheduler(b, node_timeout_s=30).tick(lease_b)
    assert sorted(r["model"] for r in b.replicas()) == ["m", "m2"], "cp-b's plan is written"
    assert lead_a.step() is None, "cp-a, awake, sees cp-b's lease and stays off"


def test_a_killed_holder_is_replaced_once_its_lease_lapses(two_stores) -> None:
    """kill -9: the lease is never released, and another takes it after the ttl, not before.
    (Control: a clean stop releases it, and the other takes it at its next try.)"""
    a, b, clock = two_stores
    lead_a, lead_b = _leader(a, "cp-a"), _leader(b, "cp-b")
    assert lead_a.step() is not None
    clock.now += 9.9
    assert lead_b.step() is None
    clock.now += 0.2
    assert lead_b.step() is not None
    lead_b.release()
    assert lead_a.step() is not None, "released: taken at once"


def test_each_change_of_who_schedules_is_said_once(two_stores, caplog) -> None:
    a, b, clock = two_stores
    lead_a, lead_b = _leader(a, "cp-a"), _leader(b, "cp-b")
    with caplog.at_level(logging.INFO, logger="llmgw.server"):
        for _ in range(3):
            lead_a.step()
            lead_b.step()
            clock.now += 1
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(":")[0] for line in lines] == ["scheduling", "not scheduling"], lines
    assert "cp-a holds the scheduler lease, epoch 1" in lines[0]
    assert "cp-b" not in lines[0] and "cp-a schedules (scheduler lease, epoch 1)" in lines[1]


def test_an_unreachable_store_stops_scheduling_and_is_tried_again(two_stores, caplog,
                                                                 monkeypatch) -> None:
    a, _, clock = two_stores
    lead = _leader(a, "cp-a")
    assert lead.step() is not None

    def down(*args: object, **kwargs: object) -> None:
        raise StoreError(sa.exc.OperationalError("SELECT", {}, Exception("connection refused")))

    with caplog.at_level(logging.INFO, logger="llmgw.server"):
        monkeypatch.setattr(a, "beat_control_plane", down)
        assert lead.step() is None and lead.step() is None and lead.lease is None
        monkeypatch.undo()
        clock.now += 1
        back = lead.step()
    assert back is not None and back.epoch == 1, "renewed: nobody else took it meanwhile"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "cannot be reached (connection refused)" in lines[0]
    assert lines[1].startswith("scheduling:"), lines


def test_the_control_plane_id_is_made_once_and_kept(tmp_path: Path) -> None:
    made = control_plane_id(tmp_path)
    assert control_plane_id(tmp_path) == made == (tmp_path / ID_FILE).read_text().strip()
    assert control_plane_id(tmp_path / "other") != made, "another state dir, another id"
