"""Join tokens, on both backends: each spent once, before it expires, by one process."""

from __future__ import annotations

import threading
from collections.abc import Callable

from llmgw.store import Store

OpenStore = Callable[..., Store]


def test_tokens_are_single_use_and_expire(open_store: OpenStore) -> None:
    now = [1000.0]
    store = open_store(clock=lambda: now[0])
    store.add_token("h1", 60)
    store.add_token("h2", 60)
    assert store.use_token("h1", "n2") == "ok"
    assert store.use_token("h1", "n3") == "used by n2"
    now[0] += 61
    assert store.use_token("h2", "n3") == "expired"
    assert store.use_token("nope", "n3") == "unknown"


def test_two_processes_spending_one_token_at_once_spend_it_once(open_store: OpenStore) -> None:
    """Two control planes on one store: the token's row is held while it is read."""
    stores = [open_store() for _ in range(4)]
    stores[0].add_token("h", 60)
    answers: list[str] = []
    go = threading.Barrier(len(stores))

    def spend(store: Store, node: str) -> None:
        go.wait()
        answers.append(store.use_token("h", node))

    threads = [threading.Thread(target=spend, args=(s, f"n{i}")) for i, s in enumerate(stores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(a.split(" by ")[0] for a in answers) == ["ok", "used", "used", "used"]


def test_a_control_plane_token_hands_its_sealed_bundle_over_once(open_store: OpenStore) -> None:
    store = open_store()
    store.add_token("cp", 60, bundle="c2VhbGVk")
    store.add_token("node", 60)
    assert store.use_control_plane_token("node", "cp2") == ("not for a control plane", "")
    assert store.use_token("node", "n2") == "ok", "control: a node's token stayed unspent"
    assert store.use_control_plane_token("cp", "cp2") == ("ok", "c2VhbGVk")
    assert store.use_control_plane_token("cp", "cp3") == ("used by cp2", "")
