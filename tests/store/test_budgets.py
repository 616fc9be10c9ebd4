"""Shares of gateway keys' minutes in the store, on both backends: a claim never takes the
fleet past the key's limit, even when gateways claim at once; settled claims keep only what
was spent; forced units count whatever is left; a refusal says when the minute frees up."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from llmgw.store import Settled, Store, Want
from llmgw.store._schema import key_budget
from llmgw.store.copy import NOT_COPIED, read


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _key(store: Store, rpm: int = 0, tpm: int = 0, key_id: str = "k1") -> None:
    store.add_key({"id": key_id, "name": key_id, "prefix": f"sk-llmgw-{key_id}",
                   "hash": f"h-{key_id}", "rpm": rpm, "tpm": tpm})


def test_claims_are_granted_up_to_the_limit_and_a_refusal_says_when_it_frees_up(
        open_store: Callable[..., Store]) -> None:
    clock = Clock()
    a, b = open_store(clock=clock), open_store(clock=clock)
    _key(a, rpm=20)
    (first,), seen = a.claim_budget("gw-a", [Want("k1", "requests", 15)], census=True)
    assert (first.amount, first.wait_s, seen) == (15, 0.0, 1)
    clock.now += 10
    (second,), seen = b.claim_budget("gw-b", [Want("k1", "requests", 15)], census=True)
    assert second.amount == 5 and seen == 2, "only what is left of the minute"
    (third,), seen = b.claim_budget("gw-b", [Want("k1", "requests", 1)])
    assert seen is None, "gateways are counted only when asked (every 5 s, not each claim)"
    assert third.amount == 0 and third.wait_s == pytest.approx(50.0), \
        "the first claim leaves the minute 60 s after it was taken"
    assert a.key_budget("k1", "requests") == {"gw-a": 15, "gw-b": 5}
    clock.now += 50.5
    (fourth,), seen = b.claim_budget("gw-b", [Want("k1", "requests", 20)], census=True)
    assert fourth.amount == 15 and seen == 1, "gw-a's claim left the minute, and its row"


def test_settled_claims_keep_what_was_spent_from_its_last_use_and_give_back_the_rest(
        open_store: Callable[..., Store]) -> None:
    clock = Clock()
    store = open_store(clock=clock)
    _key(store, rpm=10)
    (grant,), _ = store.claim_budget("gw-a", [Want("k1", "requests", 10)])
    (none,), _ = store.claim_budget("gw-b", [Want("k1", "requests", 1)])
    assert none.amount == 0, "control: the minute is spent while the claim is whole"
    clock.now += 3
    (back,), _ = store.claim_budget("gw-b", [Want("k1", "requests", 10)],
                                    [Settled(grant.claim, 4, clock.now - 1)])
    assert back.amount == 6, "the 6 unspent went back"
    clock.now += 58.5  # the claim was taken 61.5 s ago, its last use 59.5 s ago
    (later,), _ = store.claim_budget("gw-b", [Want("k1", "requests", 1)])
    assert later.amount == 0, "what was spent counts from its last use, not its claim"
    store.claim_budget("gw-c", [Want("k1", "requests", 0)], [Settled(back.claim, 0, 0.0)])
    assert store.key_budget("k1", "requests") == {"gw-a": 4}, "an unspent claim is removed"


def test_forced_units_count_whatever_is_left_and_keys_without_a_limit_grant_nothing(
        open_store: Callable[..., Store]) -> None:
    store = open_store()
    _key(store, tpm=100)
    _key(store, key_id="free")
    (grant,), _ = store.claim_budget("gw-a", [Want("k1", "tokens", 30, forced=90)])
    assert grant.amount == 10 and grant.wait_s > 0
    (over,), _ = store.claim_budget("gw-b", [Want("k1", "tokens", 5, forced=20)])
    assert over.amount == 0 and over.claim == 0
    assert sum(store.key_budget("k1", "tokens").values()) == 120, \
        "spent is spent: the answers' tokens past the limit are counted"
    grants, _ = store.claim_budget("gw-a", [Want("free", "requests", 5),
                                            Want("missing", "tokens", 5)])
    assert [g.amount for g in grants] == [0, 0]


def test_gateways_claiming_at_once_never_take_more_than_the_limit(
        open_store: Callable[..., Store]) -> None:
    """Eight threads, each its own store connection (a gateway), claim 1 to 3 units at a
    time until refused: the grants add up to the limit exactly (the key's row is locked)."""
    stores = [open_store() for _ in range(8)]
    _key(stores[0], rpm=200, tpm=100)
    got: list[int] = []

    def claim(i: int) -> None:
        while True:
            grants, _ = stores[i].claim_budget(
                f"gw-{i}", [Want("k1", "requests", 1 + i % 3), Want("k1", "tokens", 1)])
            got.append(grants[0].amount)
            if not any(g.amount for g in grants):
                return

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sum(got) == 200 and sum(stores[0].key_budget("k1", "tokens").values()) == 100


def test_copies_leave_the_shares_out(open_store: Callable[..., Store]) -> None:
    """A backup holds no shares (they mean nothing a minute later); its control: the
    table is there and holds rows."""
    store = open_store()
    _key(store, rpm=5)
    store.claim_budget("gw-a", [Want("k1", "requests", 5)])
    assert key_budget.name in NOT_COPIED and store.key_budget("k1", "requests")
    assert key_budget.name not in read(store).rows and "keys" in read(store).rows
