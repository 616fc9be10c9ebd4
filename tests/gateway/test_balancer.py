"""The balancer's rule as pure logic: least in flight within slots, affinity and its guard,
conversation keys, and the bounded queue."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from llmgw.gateway.balancer import BUSIER_BY_ABS, Balancer, Load, Saturated, choose, conversation

R1, R2 = {"id": "r1"}, {"id": "r2"}


def loads(**by_id: tuple[int, int | None]) -> dict[str, Load]:
    return {rid: Load(in_flight=n, slots=slots) for rid, (n, slots) in by_id.items()}


def chat(*contents: str, **extra: Any) -> bytes:
    roles = ["user", "assistant"]
    return json.dumps({"model": "m", **extra, "messages": [
        {"role": roles[i % 2], "content": c} for i, c in enumerate(contents)]}).encode()


def test_the_replica_with_fewest_in_flight_takes_the_request() -> None:
    assert choose([R1, R2], loads(r1=(1, 4), r2=(0, 4)), None, 0) is R2
    assert choose([R1, R2], loads(r1=(0, 4), r2=(3, 4)), None, 0) is R1


def test_equally_loaded_replicas_take_requests_in_turn() -> None:
    picks = [choose([R1, R2], loads(r1=(1, 4), r2=(1, 4)), None, t)["id"] for t in range(4)]
    assert picks == ["r1", "r2", "r1", "r2"]


def test_a_replica_at_its_slots_is_passed_over_and_none_free_gives_none() -> None:
    assert choose([R1, R2], loads(r1=(2, 2), r2=(3, 4)), None, 0) is R2
    assert choose([R1, R2], loads(r1=(2, 2), r2=(4, 4)), None, 0) is None


def test_a_replica_whose_slots_are_unknown_is_never_full() -> None:
    assert choose([R1], loads(r1=(50, None)), None, 0) is R1


def test_requests_others_run_on_a_replica_count_against_its_slots() -> None:
    balancer = Balancer()
    balancer.observe("r1", 2, busy=2)
    balancer.observe("r2", 2, busy=0)
    assert choose([R1, R2], balancer.loads, None, 0) is R2
    balancer.observe("r2", 2, busy=2)
    assert choose([R1, R2], balancer.loads, None, 0) is None


def test_a_conversation_goes_home_unless_home_is_much_busier_than_the_idlest() -> None:
    within = loads(r1=(BUSIER_BY_ABS, 8), r2=(0, 8))
    assert choose([R1, R2], within, "r1", 1) is R1
    beyond = loads(r1=(BUSIER_BY_ABS + 1, 8), r2=(0, 8))
    assert choose([R1, R2], beyond, "r1", 0) is R2
    # Past the absolute margin but within the relative one: still home.
    relative = loads(r1=(9, 16), r2=(6, 16))
    assert choose([R1, R2], relative, "r1", 1) is R1


def test_a_full_home_sends_its_conversation_to_a_free_replica() -> None:
    assert choose([R1, R2], loads(r1=(2, 2), r2=(1, 2)), "r1", 0) is R2


def test_the_next_turn_of_a_conversation_finds_the_last_turn_as_its_prefix() -> None:
    first = conversation([], chat("tell me about cats"))
    second = conversation([], chat("tell me about cats", "cats purr", "and dogs?"))
    other = conversation([], chat("tell me about dogs", "dogs bark", "and cats?"))
    assert first and second and other
    assert first.record in second.lookups and first.record not in other.lookups
    assert second.lookups[0] == second.record


def test_a_session_header_names_the_conversation_whatever_the_messages() -> None:
    a = conversation([(b"x-session-id", b"abc")], chat("one"))
    b = conversation([(b"x-session-id", b"abc")], chat("two"))
    assert a == b and a is not None and a.record == b"s:abc"


def test_a_growing_prompt_matches_at_its_chunks_and_a_body_without_either_has_none() -> None:
    base = "x" * 1100
    first = conversation([], json.dumps({"prompt": base}).encode())
    later = conversation([], json.dumps({"prompt": base + "more " * 50}).encode())
    assert first and later and first.record in later.lookups
    assert conversation([], b'{"model": "m", "input": "embed me"}') is None
    assert conversation([], b"{not json") is None


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_homes_are_remembered_in_bounded_memory_oldest_first_out() -> None:
    async def main() -> list[str]:
        balancer = Balancer(affinity_entries=2)
        balancer.observe("r1", 8, 0)
        balancer.observe("r2", 8, 0)
        convs = [conversation([(b"x-session-id", f"{i}".encode())], b"") for i in range(3)]
        homes = []
        for conv in convs:
            lease = await balancer.acquire("m", [R1, R2], conv, set())
            assert lease is not None
            homes.append(lease.replica["id"])
            lease.release()
        return [balancer._home(c) for c in convs]  # type: ignore[misc]

    assert run(main()) == [None, "r2", "r1"]


def test_a_request_beyond_every_slot_waits_and_takes_the_first_slot_freed() -> None:
    async def main() -> tuple[str, bool]:
        balancer = Balancer(queue_wait_s=5)
        balancer.observe("r1", 1, 0)
        held = await balancer.acquire("m", [R1], None, set())
        waiting = asyncio.ensure_future(balancer.acquire("m", [R1], None, set()))
        await asyncio.sleep(0.05)
        was_waiting = not waiting.done()
        held.release()  # type: ignore[union-attr]
        lease = await asyncio.wait_for(waiting, 1)
        return lease.replica["id"], was_waiting  # type: ignore[union-attr]

    assert run(main()) == ("r1", True)


def test_a_full_queue_is_refused_at_once_and_a_wait_that_runs_out_says_so() -> None:
    async def main() -> tuple[str, str]:
        balancer = Balancer(queue_size=1, queue_wait_s=0.2)
        balancer.observe("r1", 1, 0)
        await balancer.acquire("m", [R1], None, set())
        waiting = asyncio.ensure_future(balancer.acquire("m", [R1], None, set()))
        await asyncio.sleep(0.01)
        with pytest.raises(Saturated) as full:
            await balancer.acquire("m", [R1], None, set())
        with pytest.raises(Saturated) as waited:
            await waiting
        return str(full.value), str(waited.value)

    full, waited = run(main())
    assert "1 requests already wait (gateway_queue_size" in full
    assert "stayed at its slots for 0.2 s (gateway_queue_wait_s" in waited
    assert "r1: 1 in flight of 1 slots" in waited


def test_a_waiter_that_leaves_gives_up_its_place_and_leaks_no_slot() -> None:
    async def main() -> int:
        balancer = Balancer(queue_wait_s=5)
        balancer.observe("r1", 1, 0)
        held = await balancer.acquire("m", [R1], None, set())
        waiting = asyncio.ensure_future(balancer.acquire("m", [R1], None, set()))
        await asyncio.sleep(0.01)
        waiting.cancel()
        await asyncio.sleep(0.01)
        held.release()  # type: ignore[union-attr]
        return balancer.loads["r1"].in_flight

    assert run(main()) == 0


def test_round_robin_ignores_slots_and_homes() -> None:
    async def main() -> list[str]:
        balancer = Balancer("round-robin")
        balancer.observe("r1", 1, 1)
        conv = conversation([(b"x-session-id", b"s")], b"")
        picks = []
        for _ in range(4):
            lease = await balancer.acquire("m", [R1, R2], conv, set())
            picks.append(lease.replica["id"])  # type: ignore[union-attr]
        return picks

    assert run(main()) == ["r1", "r2", "r1", "r2"]


def test_replicas_already_tried_are_not_leased_again() -> None:
    async def main() -> tuple[str, Any]:
        balancer = Balancer()
        lease = await balancer.acquire("m", [R1, R2], None, {"r1"})
        none = await balancer.acquire("m", [R1, R2], None, {"r1", "r2"})
        return lease.replica["id"], none  # type: ignore[union-attr]

    assert run(main()) == ("r2", None)


def test_a_freed_slot_goes_to_a_waiter_at_home_there_before_the_first_in_line() -> None:
    async def main() -> tuple[str, bool]:
        balancer = Balancer(queue_wait_s=5)
        balancer.observe("r1", 1, 0)
        balancer.observe("r2", 1, 0)
        on_r1 = conversation([(b"x-session-id", b"a")], b"")
        on_r2 = conversation([(b"x-session-id", b"b")], b"")
        held1 = await balancer.acquire("m", [R1, R2], on_r1, set())
        held2 = await balancer.acquire("m", [R1, R2], on_r2, set())
        assert held1 and held2 and (held1.replica, held2.replica) == (R1, R2)
        first = asyncio.ensure_future(balancer.acquire("m", [R1, R2], on_r2, set()))
        await asyncio.sleep(0.01)
        second = asyncio.ensure_future(balancer.acquire("m", [R1, R2], on_r1, set()))
        await asyncio.sleep(0.01)
        held1.release()
        lease = await asyncio.wait_for(second, 1)
        return lease.replica["id"], first.done()  # type: ignore[union-attr]

    assert run(main()) == ("r1", False)


@pytest.mark.parametrize("new_first", [True, False])
def test_a_new_conversation_in_line_is_not_passed_over_for_a_returning_one(
        new_first: bool) -> None:
    """A new conversation (no home) first in line takes the freed slot before a returning
    one at home there: a slot is its to take in its turn, so it is not passed over for as
    long as conversations keep coming back (TTFT p99). The negative control: the
    returning one first in line goes first."""
    async def main() -> list[str]:
        balancer = Balancer(queue_wait_s=5)
        balancer.observe("r1", 1, 0)
        balancer.observe("r2", 1, 0)
        on_r1 = conversation([(b"x-session-id", b"a")], b"")
        new = conversation([(b"x-session-id", b"new")], b"")
        held1 = await balancer.acquire("m", [R1, R2], on_r1, set())
        held2 = await balancer.acquire("m", [R1, R2], None, set())
        assert held1 and held2 and held1.replica == R1
        order = [new, on_r1] if new_first else [on_r1, new]
        waiting = []
        for conv in order:
            waiting.append(asyncio.ensure_future(balancer.acquire("m", [R1, R2], conv, set())))
            await asyncio.sleep(0.01)
        held1.release()
        await asyncio.sleep(0.01)
        return ["new" if w is waiting[order.index(new)] else "returning"
                for w in waiting if w.done()]

    assert run(main()) == (["new"] if new_first else ["returning"])


def test_a_freed_slot_goes_to_the_first_in_line_when_none_is_at_home_there() -> None:
    async def main() -> str:
        balancer = Balancer(queue_wait_s=5)
        balancer.observe("r1", 1, 0)
        balancer.observe("r2", 1, 0)
        on_r2 = conversation([(b"x-session-id", b"b")], b"")
        held1 = await balancer.acquire("m", [R1, R2], None, set())
        await balancer.acquire("m", [R1, R2], on_r2, set())
        first = asyncio.ensure_future(balancer.acquire("m", [R1, R2], on_r2, set()))
        await asyncio.sleep(0.01)
        held1.release()  # type: ignore[union-attr]
        lease = await asyncio.wait_for(first, 1)
        return lease.replica["id"]  # type: ignore[union-attr]

    assert run(main()) == "r1"


def test_slots_are_counted_from_llama_servers_answer_and_anything_else_is_unknown() -> None:
    from llmgw.gateway._slots import slots_of

    answer = [{"id": 0, "is_processing": True}, {"id": 1, "is_processing": False}]
    assert slots_of(answer) == (2, 1)
    assert slots_of([]) is None and slots_of({"error": "x"}) is None
    assert slots_of([{"id": 0}]) is None


def test_loads_of_replicas_gone_from_ready_are_forgotten_once_idle() -> None:
    balancer = Balancer()
    balancer.observe("r1", 2, 0)
    balancer.observe("r2", 2, 0)
    balancer.loads["r2"].in_flight = 1
    balancer.prune({"r3"})
    assert set(balancer.loads) == {"r2"}


def test_busy_slots_of_requests_that_ended_while_the_poll_was_out_are_not_others() -> None:
    """Two requests of this gateway ran when the engine counted 2 busy and ended before
    its answer came: no slot is anyone else's. A third busy slot is."""
    async def main() -> tuple[int, int]:
        balancer = Balancer()
        balancer.observe("r1", 4, 0)
        leases = [await balancer.acquire("m", [R1], None, set()) for _ in range(2)]
        balancer.polling("r1")
        for lease in leases:
            lease.release()  # type: ignore[union-attr]
        balancer.observe("r1", 4, busy=2)
        ended = balancer.loads["r1"].others
        balancer.polling("r1")
        balancer.observe("r1", 4, busy=3)
        return ended, balancer.loads["r1"].others

    assert run(main()) == (0, 3)
