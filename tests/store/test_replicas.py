"""Replicas, on both backends: records checked before they are stored, replaced whole,
updated by field, pruned once stopped long enough."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from llmgw.contract.records import RecordError
from llmgw.store import Store

OpenStore = Callable[..., Store]
ROW = {"id": "r1", "model": "m", "node": "", "profile": "cpu", "state": "pending"}


def test_a_replica_with_an_unknown_state_or_key_is_refused_and_not_stored(
        open_store: OpenStore) -> None:
    store = open_store()
    with pytest.raises(RecordError, match="state is 'paused': Input should be 'pending'"):
        store.put_replica({**ROW, "state": "paused"})
    with pytest.raises(RecordError, match="colour is not a known key"):
        store.put_replica({**ROW, "colour": "red"})
    assert store.replicas() == []
    store.put_replica(ROW)  # negative control: the valid record is stored
    with pytest.raises(RecordError, match="state"):
        store.update_replica("r1", state="paused")
    assert [r["state"] for r in store.replicas()] == ["pending"]


def test_a_put_replaces_and_an_update_changes_only_its_fields(open_store: OpenStore) -> None:
    now = [10.0]
    store = open_store(clock=lambda: now[0])
    store.put_replica({**ROW, "gpus": ["GPU-1"], "endpoint": "http://a"})
    store.put_replica({**ROW, "node": "n2"})
    (r,) = store.replicas()
    assert (r["node"], r["gpus"], r["endpoint"]) == ("n2", [], ""), "replaced whole"
    now[0] = 20.0
    store.update_replica("r1", state="ready", gpus=["GPU-2", "GPU-3"])
    (r,) = store.replicas("m")
    assert (r["state"], r["gpus"], r["node"], r["updated"]) == (
        "ready", ["GPU-2", "GPU-3"], "n2", 20.0)
    assert store.replicas("other") == []
    with pytest.raises(ValueError, match="must be among"):
        store.update_replica("r1", model="x")


def test_stopped_replicas_are_pruned_once_old_enough(open_store: OpenStore) -> None:
    now = [100.0]
    store = open_store(clock=lambda: now[0])
    store.put_replica({**ROW, "state": "stopped"})
    store.put_replica({**ROW, "id": "r2", "state": "ready"})
    now[0] = 150.0
    assert store.prune_stopped(60) == 0, "stopped 50 s ago: kept"
    now[0] = 161.0
    assert store.prune_stopped(60) == 1
    assert [r["id"] for r in store.replicas()] == ["r2"]
