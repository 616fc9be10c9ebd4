"""What gateways see of each model's use (store/demand.py): each gateway's rows, summed by
the scheduler over the gateways that wrote lately."""

from __future__ import annotations

from collections.abc import Callable

from llmgw.store import Store, Use
from llmgw.store.demand import DEMAND_FRESH_S, DEMAND_KEEP_S


def test_uses_sum_fresh_gateways_and_keep_a_stale_ones_last_use(
        open_store: Callable[..., Store]) -> None:
    now = [1000.0]
    store = open_store(clock=lambda: now[0])
    store.report_use("g1", {"m": Use(waiting=2, in_flight=1, last_used=990.0)})
    store.report_use("g1", {"m": Use(waiting=1, in_flight=0, last_used=995.0)})  # rewritten
    store.report_use("g2", {"m": Use(waiting=3, in_flight=2, last_used=980.0),
                            "other": Use(last_used=900.0)})
    assert store.uses() == {"m": Use(4, 2, 995.0), "other": Use(0, 0, 900.0)}
    # g2 goes silent: past DEMAND_FRESH_S its waiting and in-flight count for nothing, its
    # last use still counts.
    now[0] += DEMAND_FRESH_S + 1
    store.report_use("g1", {"m": Use(waiting=1, in_flight=0, last_used=995.0)})
    assert store.uses() == {"m": Use(1, 0, 995.0), "other": Use(0, 0, 900.0)}


def test_rows_no_gateway_rewrote_for_a_day_go(open_store: Callable[..., Store]) -> None:
    now = [1000.0]
    store = open_store(clock=lambda: now[0])
    store.report_use("gone", {"m": Use(last_used=990.0)})
    now[0] += DEMAND_KEEP_S - 1
    store.report_use("g1", {"other": Use(last_used=now[0])})
    assert "m" in store.uses()  # control: within the day it stays
    now[0] += 2
    store.report_use("g1", {"other": Use(last_used=now[0])})
    assert "m" not in store.uses()
