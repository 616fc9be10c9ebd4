"""What a heartbeat writes, on both backends: a beat that changes nothing writes nothing at
once, a changed one at once; an unchanged node's row is written again often enough that
another control plane on the same store never counts it lost; the replicas a beat answers
with follow this store's writes at once and another's within REPLICAS_FRESH_S."""

from __future__ import annotations

from collections.abc import Callable

from llmgw.control.nodes import node_view
from llmgw.store import Store
from llmgw.store.nodes import FLUSH_EVERY_S, REPLICAS_FRESH_S

OpenStore = Callable[..., Store]
TIMEOUT_S = 30.0
INVENTORY = {"cpus": 2, "engines": ["llamacpp"], "gpus": [
    {"index": 0, "uuid": "GPU-1", "class": "l4", "memory_mb": 24000,
     "memory_free_mb": 20000}]}
SPEC = {"name": "m", "source": "http://mirror/m.gguf", "sha256": "",
        "profiles": [{"name": "cpu", "engine": "llamacpp", "gpu_class": "", "args": []}]}


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def stored_last_seen(other: Store, node: str) -> float:
    """What a control plane that did not hear the beat reads (nothing of it in memory)."""
    found = other.node(node)
    assert found is not None, f"{node} is not in the store"
    return found["last_seen"]


def test_an_unchanged_beat_writes_nothing_at_once_and_a_changed_one_does(
        open_store: OpenStore) -> None:
    clock = Clock()
    here, other = open_store(clock=clock), open_store(clock=clock)
    here.heartbeat("n1", INVENTORY, "S1", {}, rewrite_every_s=10.0)
    assert stored_last_seen(other, "n1") == 1000.0, "a node's first beat is written at once"
    clock.now = 1005.0
    here.heartbeat("n1", dict(INVENTORY), "S1", {}, rewrite_every_s=10.0)
    assert stored_last_seen(other, "n1") == 1000.0, "an unchanged beat is not written"
    assert here.node("n1")["last_seen"] == 1005.0, "but the process that heard it says it"
    # Negative control: the same beat with one card's free memory changed is written at once.
    clock.now = 1006.0
    changed = {**INVENTORY, "gpus": [{**INVENTORY["gpus"][0], "memory_free_mb": 19000}]}
    here.heartbeat("n1", changed, "S1", {}, rewrite_every_s=10.0)
    assert stored_last_seen(other, "n1") == 1006.0
    assert other.node("n1")["inventory"]["gpus"][0]["memory_free_mb"] == 19000
    # And a new serial (a renewed certificate) is a change too.
    clock.now = 1007.0
    here.heartbeat("n1", changed, "S2", {}, rewrite_every_s=10.0)
    assert other.node("n1")["serial"] == "S2"


def test_another_control_plane_never_counts_a_node_beating_unchanged_lost(
        open_store: OpenStore) -> None:
    clock = Clock()
    here, other = open_store(clock=clock), open_store(clock=clock)

    def most_silence(rewrite_every_s: float, node: str) -> float:
        """Beats every 5 s for three node timeouts; the longest silence the other control
        plane saw (checked after every beat and every second between)."""
        most = 0.0
        for _ in range(int(3 * TIMEOUT_S / 5)):
            here.heartbeat(node, INVENTORY, "S", {}, rewrite_every_s=rewrite_every_s)
            for _ in range(5):
                most = max(most, clock.now - stored_last_seen(other, node))
                view = node_view(other.node(node), clock.now, TIMEOUT_S)  # type: ignore[arg-type]
                assert view["state"] == "ready" or rewrite_every_s > TIMEOUT_S, view
                clock.now += 1.0
        return most

    # A third of the node timeout, as the agent API passes: rewritten within the bound.
    assert most_silence(TIMEOUT_S / 3, "n1") <= TIMEOUT_S / 3 + 5 + FLUSH_EVERY_S
    # Negative control: rewritten less often than the timeout, the other one loses it.
    assert most_silence(2 * TIMEOUT_S, "n2") > TIMEOUT_S


def test_a_node_removed_is_not_written_back_by_a_later_flush(open_store: OpenStore) -> None:
    clock = Clock()
    here = open_store(clock=clock)

    def beat(node: str) -> None:
        here.heartbeat(node, INVENTORY, "S", {}, rewrite_every_s=10.0)

    for clock.now in (1000.0, 1005.0):  # every 5 s, as agents beat
        for node in ("gone", "kept", "third"):
            beat(node)
    clock.now = 1010.0
    beat("third")  # due, and written at once: the next flush is a second away
    clock.now = 1010.2
    beat("gone")
    beat("kept")  # both due, for that next flush
    here.remove_node("gone", "removed by the admin")
    clock.now = 1010.2 + FLUSH_EVERY_S
    beat("third")  # not due itself: it flushes what is
    other = open_store(clock=clock)
    assert [n["id"] for n in other.nodes()] == ["kept", "third"]
    # Negative control: that flush did write what was due beside it.
    assert stored_last_seen(other, "kept") == 1010.2


def test_a_beat_answers_with_replicas_this_store_wrote_at_once_and_another_soon(
        open_store: OpenStore) -> None:
    clock = Clock()
    here, other = open_store(clock=clock), open_store(clock=clock)
    here.add_model(SPEC)
    assert here.heartbeat("n1", INVENTORY, "S", {}) == []
    here.put_replica({"id": "r1", "model": "m", "node": "n1", "profile": "cpu",
                      "state": "pending"})
    assert [r["id"] for r in here.heartbeat("n1", INVENTORY, "S", {})] == ["r1"], \
        "this store's own write is answered with at once"
    other.put_replica({"id": "r2", "model": "m", "node": "n1", "profile": "cpu",
                       "state": "pending"})
    # Negative control of the bound below: within it, another process's write may wait.
    assert [r["id"] for r in here.heartbeat("n1", INVENTORY, "S", {})] == ["r1"]
    clock.now += REPLICAS_FRESH_S
    assert [r["id"] for r in here.heartbeat("n1", INVENTORY, "S", {})] == ["r1", "r2"]


def test_a_report_on_a_replica_another_control_plane_stopped_does_not_revive_it(
        open_store: OpenStore) -> None:
    clock = Clock()
    here, other = open_store(clock=clock), open_store(clock=clock)
    here.add_model(SPEC)
    for rid in ("r1", "r2"):
        here.put_replica({"id": rid, "model": "m", "node": "n1", "profile": "cpu",
                          "state": "pending"})
    here.heartbeat("n1", INVENTORY, "S", {})
    other.put_replica({"id": "r1", "model": "m", "node": "n1", "profile": "cpu",
                       "state": "stopped", "err": "stopped by the scheduler"})
    ready = {"state": "ready", "err": "", "endpoint": "http://n1:1", "api_key": "k"}
    # This store still holds r1 as live (within REPLICAS_FRESH_S) and takes the report:
    here.heartbeat("n1", INVENTORY, "S", {"r1": ready, "r2": ready})
    states = {r["id"]: r["state"] for r in other.replicas()}
    assert states["r1"] == "stopped", "a stopped replica stays stopped"
    # Negative control: the same report on the replica still live is taken.
    assert states["r2"] == "ready"
