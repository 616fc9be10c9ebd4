"""A key's use in the gateway: the per-minute windows, Retry-After and the usage batches
(the shares of a limit: test_shares.py)."""

from __future__ import annotations

import pytest

from llmgw.gateway import _limits


def test_a_window_admits_up_to_its_limit_then_says_when_the_oldest_leaves() -> None:
    w = _limits.Window(limit=3, span_s=60)
    for t in (0.0, 10.0, 20.0):
        assert w.wait_s(t) == 0
        w.add(t, 1)
    assert w.wait_s(30.0) == pytest.approx(30.0)  # the entry of t=0 leaves at 60
    assert w.wait_s(60.0) == 0  # ... and has left
    w.add(60.0, 1)
    assert w.wait_s(65.0) == pytest.approx(5.0)
    assert w.total == 3


def test_a_window_of_tokens_waits_until_enough_falls_out() -> None:
    w = _limits.Window(limit=100)
    w.add(0.0, 60)
    w.add(10.0, 50)
    assert w.wait_s(20.0) == pytest.approx(40.0)  # 110 spent: the 60 must go first
    assert w.wait_s(20.0, 0) == pytest.approx(40.0)
    assert w.wait_s(61.0) == 0 and w.total == 50


def test_a_window_counts_what_was_spent_since_and_takes_another_limit() -> None:
    w = _limits.Window(limit=100)
    w.add(0.0, 60)
    w.add(10.0, 50)
    assert w.since(5.0) == 50 and w.since(-1.0) == 110 and w.since(10.0) == 0
    assert w.wait_s(20.0, 1, limit=200) == 0 and w.wait_s(20.0, 1, limit=60) == \
        pytest.approx(40.0)


def test_retry_after_is_whole_seconds_rounded_up() -> None:
    assert [_limits.retry_after(s) for s in (0.001, 1.0, 1.2, 59.9)] == ["1", "1", "2", "60"]


def test_usage_gathers_per_key_and_goes_back_when_it_could_not_be_written() -> None:
    usage = _limits.Usage()
    usage.add("a", 10.0, 3, 5)
    usage.add("a", 12.0, 1, 1)
    usage.add("b", 11.0, 0, 0)
    taken = usage.take()
    assert taken == {"a": (2, 4, 6, 12.0), "b": (1, 0, 0, 11.0)} and usage.take() == {}
    usage.add("a", 20.0, 1, 2)
    usage.put_back(taken)
    assert usage.take() == {"a": (3, 5, 8, 20.0), "b": (1, 0, 0, 11.0)}
