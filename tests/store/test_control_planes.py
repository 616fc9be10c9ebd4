"""Control planes sharing a store, on both backends: each one's row, and the scheduler
lease (taken when free or expired under a new epoch, renewed under the same, refused while
another holds it) that fences every placement write."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from llmgw.control.scheduler import Plan
from llmgw.store import Lease, LeaseLost, Store

OpenStore = Callable[..., Store]
ROW = {"id": "r1", "model": "m", "node": "", "profile": "cpu", "state": "pending"}


class Clock:
    """The time both stores read: the test moves it."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_each_control_plane_beats_its_row_and_keeps_its_start(open_store: OpenStore) -> None:
    clock = Clock()
    store = open_store(clock=clock)
    assert store.control_planes() == []
    store.beat_control_plane("cp-a", "https://a:7443", "http://a:9090", started=990.0)
    clock.now = 1005.0
    store.beat_control_plane("cp-a", "https://a:7443", "http://a:9091")
    store.beat_control_plane("cp-b", "https://b:7443", "http://b:9090")
    assert store.control_planes() == [
        {"id": "cp-a", "agent_url": "https://a:7443", "admin_url": "http://a:9091",
         "started": 990.0, "last_seen": 1005.0},
        {"id": "cp-b", "agent_url": "https://b:7443", "admin_url": "http://b:9090",
         "started": 1005.0, "last_seen": 1005.0}]
    store.beat_control_plane("cp-a", "https://a:7443", "http://a:9091", started=1004.0)
    assert store.control_planes()[0]["started"] == 1004.0, "a restart gives its start again"


def test_a_control_plane_silent_for_a_day_is_forgotten_by_the_next_beat(
        open_store: OpenStore) -> None:
    """Its row goes at another's beat; the control, one silent for less, is kept."""
    from llmgw.store.control_planes import FORGET_AFTER_S

    clock = Clock()
    store = open_store(clock=clock)
    store.beat_control_plane("cp-gone", "https://g:7443", "http://g:9090")
    clock.now += FORGET_AFTER_S - 60
    store.beat_control_plane("cp-quiet", "https://q:7443", "http://q:9090")
    store.beat_control_plane("cp-a", "https://a:7443", "http://a:9090")
    assert [cp["id"] for cp in store.control_planes()] == ["cp-a", "cp-gone", "cp-quiet"]
    clock.now += 61
    store.beat_control_plane("cp-a", "https://a:7443", "http://a:9090")
    assert [cp["id"] for cp in store.control_planes()] == ["cp-a", "cp-quiet"]


def test_the_lease_is_one_holders_until_it_expires_then_the_next_takers_epoch(
        open_store: OpenStore) -> None:
    clock = Clock()
    a, b = open_store(clock=clock), open_store(clock=clock)
    assert a.lease() is None, "nobody ever took it"
    assert a.acquire_lease("cp-a", 10) == Lease("scheduler", "cp-a", 1, 1010.0)
    assert b.acquire_lease("cp-b", 10) is None, "cp-a holds it unexpired"
    clock.now = 1005.0
    assert a.acquire_lease("cp-a", 10) == Lease("scheduler", "cp-a", 1, 1015.0), "renewed"
    clock.now = 1014.9
    assert b.acquire_lease("cp-b", 10) is None
    clock.now = 1015.0
    assert b.acquire_lease("cp-b", 10) == Lease("scheduler", "cp-b", 2, 1025.0), "expired"
    assert a.acquire_lease("cp-a", 10) is None
    assert a.lease() == Lease("scheduler", "cp-b", 2, 1025.0)


def test_a_holder_whose_lease_lapsed_takes_it_again_only_under_a_new_epoch(
        open_store: OpenStore) -> None:
    """A lapsed lease is a new term even for the same holder, so a write prepared under
    the old epoch is refused. (Control: an unexpired renewal keeps the epoch, above.)"""
    clock = Clock()
    store = open_store(clock=clock)
    old = store.acquire_lease("cp-a", 10)
    clock.now = 1011.0
    new = store.acquire_lease("cp-a", 10)
    assert old is not None and new is not None and (old.epoch, new.epoch) == (1, 2)
    with pytest.raises(LeaseLost, match="no longer cp-a's under epoch 1: cp-a holds it now "
                                        "under epoch 2"):
        store.apply_plan(Plan(add=[ROW]), old)
    assert store.replicas() == []
    store.apply_plan(Plan(add=[ROW]), new)
    assert [r["id"] for r in store.replicas()] == ["r1"]


def test_a_released_lease_is_taken_at_once_and_the_old_epoch_writes_nothing(
        open_store: OpenStore) -> None:
    clock = Clock()
    a, b = open_store(clock=clock), open_store(clock=clock)
    lease = a.acquire_lease("cp-a", 10)
    assert lease is not None and a.release_lease(lease)
    with pytest.raises(LeaseLost, match="lapsed and nobody has taken it since"):
        a.apply_plan(Plan(add=[ROW]), lease)
    assert b.acquire_lease("cp-b", 10) == Lease("scheduler", "cp-b", 2, 1010.0)
    assert not a.release_lease(lease), "no longer cp-a's: cp-b's lease is left alone"
    assert b.acquire_lease("cp-a", 10) is None


def test_a_frozen_holder_woken_past_its_lease_writes_no_placement(
        open_store: OpenStore) -> None:
    """cp-a plans under epoch 1, is frozen (SIGSTOP) past its lease, cp-b takes over and
    places; woken, cp-a's plan is refused whole, and cp-b's placement stands. (Control:
    the same plan under a current lease is written whole, in one transaction.)"""
    clock = Clock()
    a, b = open_store(clock=clock), open_store(clock=clock)
    a.put_replica({**ROW, "id": "r0"})
    a.put_replica({**ROW, "id": "r9", "state": "ready", "node": "n1"})
    stale = a.acquire_lease("cp-a", 10)
    assert stale is not None
    frozen_plan = Plan(add=[{**ROW, "id": "r-a"}], stop={"r9": "cp-a's reason"},
                       place={"r0": ("n1", "cpu", ["GPU-A"])}, waiting={})
    clock.now = 1020.0  # cp-a sleeps through its lease
    current = b.acquire_lease("cp-b", 10)
    assert current is not None and current.epoch == 2
    b.apply_plan(Plan(place={"r0": ("n2", "cpu", ["GPU-B"])}), current)
    clock.now = 1021.0  # cp-a wakes and writes what it had planned
    with pytest.raises(LeaseLost) as lost:
        a.apply_plan(frozen_plan, stale)
    assert "cp-b holds it now under epoch 2" in str(lost.value)
    assert "nothing was written" in str(lost.value)
    by_id = {r["id"]: r for r in a.replicas()}
    assert set(by_id) == {"r0", "r9"}, "cp-a's new replica was not added"
    assert by_id["r9"]["state"] == "ready", "nor its stop written"
    assert (by_id["r0"]["node"], by_id["r0"]["gpus"]) == ("n2", ["GPU-B"]), "cp-b's stands"
    b.apply_plan(Plan(add=[{**ROW, "id": "r-b"}], stop={"r9": "cp-b's reason"}), current)
    by_id = {r["id"]: r for r in a.replicas()}
    assert set(by_id) == {"r0", "r9", "r-b"}
    assert (by_id["r9"]["state"], by_id["r9"]["err"]) == ("stopped", "cp-b's reason")


def test_a_plan_is_written_whole_or_not_at_all(open_store: OpenStore) -> None:
    """A bad record in a plan writes none of it, the stops before it included."""
    store = open_store()
    store.put_replica({**ROW, "state": "ready", "node": "n1"})
    with pytest.raises(ValueError, match="state"):
        store.apply_plan(Plan(add=[{**ROW, "id": "r2", "state": "paused"}],
                              stop={"r1": "why"}), None)
    assert [r["state"] for r in store.replicas()] == ["ready"]
    store.apply_plan(Plan(stop={"r1": "why"}), None)
    assert [r["state"] for r in store.replicas()] == ["stopped"]


def test_a_plan_prunes_long_stopped_replicas_in_its_transaction(open_store: OpenStore) -> None:
    clock = Clock(100.0)
    store = open_store(clock=clock)
    store.put_replica({**ROW, "state": "stopped"})
    clock.now = 150.0
    store.apply_plan(Plan(), None, keep_stopped_s=60)
    assert len(store.replicas()) == 1, "stopped 50 s ago: kept"
    clock.now = 161.0
    store.apply_plan(Plan(), None, keep_stopped_s=60)
    assert store.replicas() == []


def test_control_planes_starting_at_once_elect_exactly_one(open_store: OpenStore) -> None:
    """Four stores (four processes' view) take a lease nobody ever held, at once: one wins,
    epoch 1. (Control: once it expires, one of the others takes it, epoch 2.)"""
    import threading

    clock = Clock()
    stores = [open_store(clock=clock) for _ in range(4)]
    won: list[Lease | None] = [None] * 4
    go = threading.Barrier(4)

    def take(i: int) -> None:
        go.wait()
        won[i] = stores[i].acquire_lease(f"cp-{i}", 10)

    threads = [threading.Thread(target=take, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    winners = [lease for lease in won if lease is not None]
    assert [w.epoch for w in winners] == [1], won
    clock.now = 1011.0
    others = [s.acquire_lease(f"cp-{i}", 10) for i, s in enumerate(stores)
              if won[i] is None]
    assert [o.epoch for o in others if o is not None] == [2]
