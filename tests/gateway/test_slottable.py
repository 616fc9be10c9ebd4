"""The gateway's slot table as pure logic: a conversation back to the slot that holds it,
a busy slot not waited on, the engine's own pick where the gateway does not pin, slots of
a restarted engine forgotten, the table's bound, and the decisions' metric."""

from __future__ import annotations

import json
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from llmgw.gateway import _slottable as st
from llmgw.gateway.balancer import AFFINITY_ENTRIES, Balancer, Conversation, Lease, conversation

SYSTEM = "You are the archivist of a harbor town."


def replica(rid: str, port: int = 1) -> Any:
    return {"id": rid, "endpoint": f"http://127.0.0.1:{port}"}


R1, R2 = replica("r1", 1), replica("r2", 2)


def polled(slots: int = 2, *rids: str) -> Balancer:
    """A balanced balancer whose replicas' /slots listed `slots` idle, empty slots."""
    balancer = Balancer()
    for rid in rids or ("r1", "r2"):
        balancer.observe(rid, slots, 0, [(False, 0)] * slots)
    return balancer


def chat(*contents: str) -> bytes:
    roles = ["user", "assistant"]
    messages = [{"role": "system", "content": SYSTEM}] + [
        {"role": roles[i % 2], "content": c} for i, c in enumerate(contents)]
    return json.dumps({"model": "m", "messages": messages}).encode()


def turn(balancer: Balancer, *contents: str, replicas: Any = (R1, R2)) -> Lease:
    raw = chat(*contents)
    lease = balancer.try_now("m", list(replicas), conversation([], raw))
    assert lease is not None, "a free replica"
    return lease


def sent(lease: Lease, *contents: str) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(lease.body(chat(*contents)))
    return body


def test_each_turn_goes_back_to_the_slot_that_holds_the_conversation() -> None:
    """Turn 1 is new: the engine places it (no id_slot), on the slot it will take. Turns 2
    and 3 go to that replica and slot, pinned (id_slot)."""
    balancer = polled()
    first = turn(balancer, "tell me of the harbor")
    assert (first.reason, first.slot) == (st.NEW, None)
    assert "id_slot" not in sent(first, "tell me of the harbor")
    home = (first.replica["id"], first.tracked)
    first.release()
    history = ["tell me of the harbor", "it is old", "and the lighthouse?"]
    for more in (["it is tall", "who keeps it?"], []):
        lease = turn(balancer, *history)
        assert (lease.reason, lease.replica["id"], lease.slot) == (st.SLOT, *home)
        assert sent(lease, *history)["id_slot"] == home[1]
        lease.release()
        history += more
    assert balancer.decisions[st.SLOT] == 2


def test_negative_control_a_conversation_the_table_lost_is_new_again() -> None:
    balancer = Balancer(affinity_entries=0)
    balancer.observe("r1", 2, 0, [(False, 0)] * 2)
    turn(balancer, "tell me of the harbor", replicas=[R1]).release()
    lease = turn(balancer, "tell me of the harbor", "it is old", "and then?", replicas=[R1])
    assert (lease.reason, lease.slot) == (st.NEW, None)


def test_a_busy_slot_is_not_waited_on() -> None:
    """The conversation's slot is busy (a request of it still runs there): the next one is
    not pinned behind it. No idle slot holds as much, so it goes to its replica, unpinned,
    and the engine runs it in another slot."""
    balancer = polled()
    turn(balancer, "a").release()
    running = turn(balancer, "a", "b", "c")
    assert running.reason == st.SLOT
    again = turn(balancer, "a", "b", "c")
    assert (again.reason, again.slot) == (st.SLOT_BUSY, None)
    assert again.replica is running.replica and again.tracked != running.slot
    assert "id_slot" not in sent(again, "a", "b", "c")


def test_negative_control_without_the_rule_the_request_is_pinned_behind_the_busy_slot(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule removed (a leased slot counts as idle): the request is sent with the busy
    slot's id_slot, where llama-server defers it until that slot is free."""
    monkeypatch.setattr(st.Slot, "idle", property(lambda self: not self.others))
    balancer = polled()
    turn(balancer, "a").release()
    running = turn(balancer, "a", "b", "c")
    again = turn(balancer, "a", "b", "c")
    assert (again.reason, again.slot) == (st.SLOT, running.slot)


def test_a_busy_slot_gives_way_to_an_idle_slot_holding_as_much() -> None:
    """Two requests of one history ran at once (one pinned, one placed by the engine), so
    two slots hold it. With the one the table names busy, the next goes to the other,
    pinned."""
    balancer = polled(3, "r1")
    turn(balancer, "a", replicas=[R1]).release()
    one = turn(balancer, "a", "b", "c", replicas=[R1])
    two = turn(balancer, "a", "b", "c", replicas=[R1])
    assert (one.reason, two.reason) == (st.SLOT, st.SLOT_BUSY)
    two.release()
    one.release()
    three = turn(balancer, "a", "b", "c", replicas=[R1])  # the table's slot: two's
    four = turn(balancer, "a", "b", "c", replicas=[R1])
    assert (three.reason, three.slot) == (st.SLOT, two.tracked)
    assert (four.reason, four.slot) == (st.SLOT_BUSY_PREFIX, one.slot)


def test_where_the_gateway_does_not_pin_it_counts_the_slot_the_engine_takes() -> None:
    """llama-server under --slot-prompt-similarity 0 takes the least recently used idle
    slot, the last of equals: the table notes the conversation there."""
    balancer = polled(3, "r1")
    picks = []
    for name in ("a", "b", "c"):
        lease = turn(balancer, name, replicas=[R1])
        picks.append(lease.tracked)
    assert picks == [2, 1, 0]
    states = balancer.loads["r1"].states
    for lease_slot in (1, 2, 0):
        states[lease_slot].leased = 0
        balancer._clock += 1
        states[lease_slot].used = balancer._clock
    assert st.engine_pick(states) == 1


def test_a_slot_that_holds_another_conversation_since_sends_it_to_its_replica_unpinned() -> None:
    balancer = polled(1, "r1")
    turn(balancer, "a", replicas=[R1]).release()
    turn(balancer, "b", replicas=[R1]).release()  # the engine's only slot: b's now
    lease = turn(balancer, "a", "x", "y", replicas=[R1])
    assert (lease.reason, lease.slot) == (st.REPLICA, None)


@pytest.mark.parametrize("restarted", [True, False])
def test_the_slots_of_a_restarted_engine_are_forgotten(restarted: bool) -> None:
    """The replica's engine restarted on another port: its slots hold nothing, so the next
    turn is not pinned (the engine computes it). The negative control: the same engine."""
    balancer = polled(2, "r1")
    turn(balancer, "a", replicas=[R1]).release()
    moved = replica("r1", 9) if restarted else R1
    lease = turn(balancer, "a", "b", "c", replicas=[moved])
    assert (lease.reason, lease.slot is None) == \
        ((st.REPLICA, True) if restarted else (st.SLOT, False))


@pytest.mark.parametrize("tokens", [0, 300])
def test_a_slot_the_engine_lists_empty_is_forgotten(tokens: int) -> None:
    """A poll lists the slot idle with no tokens (its engine restarted, or purged it for
    room): the conversation is not pinned there. With tokens (the control), it is."""
    balancer = polled(2, "r1")
    first = turn(balancer, "a", replicas=[R1])
    first.release()
    balancer.polling("r1")
    seen = [(False, 300)] * 2
    seen[first.tracked or 0] = (False, tokens)
    balancer.observe("r1", 2, 0, seen)
    lease = turn(balancer, "a", "b", "c", replicas=[R1])
    assert lease.reason == (st.REPLICA if tokens == 0 else st.SLOT)


@pytest.mark.parametrize("cap", [AFFINITY_ENTRIES, 200_000])
def test_the_table_stays_under_its_cap_under_100000_conversations(cap: int) -> None:
    """100,000 conversations, one request each: the table keeps the newest `cap`, the
    oldest out first. The negative control: a cap above 100,000 holds them all."""
    balancer = Balancer(affinity_entries=cap)
    balancer.observe("r1", 4, 0, [(False, 0)] * 4)
    keys = [i.to_bytes(16, "big") for i in range(100_000)]
    for key in keys:
        lease = balancer.try_now("m", [R1], Conversation((key,), key))
        assert lease is not None
        lease.release()
    assert len(balancer.homes) == min(cap, 100_000)
    assert balancer._home(Conversation((keys[-1],), keys[-1])) == "r1"
    assert (balancer._home(Conversation((keys[0],), keys[0])) is None) == (cap < 100_000)


def test_a_pinned_body_gets_id_slot_first_and_is_otherwise_unchanged() -> None:
    from llmgw.gateway.balancer import with_slot

    raw = b'  {"model":"m","messages":[{"role":"user","content":"\\u2028 x"}]}'
    assert with_slot(raw, 3) == b'  {"id_slot":3,"model":"m","messages":[{"role":"user",' \
        b'"content":"\\u2028 x"}]}'
    assert json.loads(with_slot(raw, 3))["id_slot"] == 3


def test_the_decisions_are_counted_as_llmgw_route_decisions_total() -> None:
    balancer = polled()
    turn(balancer, "a").release()
    turn(balancer, "a", "b", "c").release()
    registry = CollectorRegistry()
    registry.register(st.RouteDecisions(balancer.decisions))
    text = generate_latest(registry).decode()
    assert 'llmgw_route_decisions_total{reason="new"} 1.0' in text
    assert 'llmgw_route_decisions_total{reason="slot"} 1.0' in text
    assert 'llmgw_route_decisions_total{reason="guard"} 0.0' in text

