"""The scheduler's pause between ticks (control/server.py `_next_tick`): it ends as soon as
requests start waiting for a model none waited for at the last look (a gateway's demand
row, written as a wait begins), so a model at zero is placed at once, not at the next
1 s tick. A real store; the gateway's part played by writing its row."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw.control.server import _next_tick
from llmgw.store import Store, Use


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    """Function: an empty store on SQLite."""
    s = Store(tmp_path / "db.sqlite")
    yield s
    s.close()


def pause_with_a_wait_after(store: Store, leading: bool, after_s: float,
                            waited: frozenset[str] = frozenset()
                            ) -> tuple[frozenset[str], float]:
    """The pause, with model m waited for after_s into it; returns what it saw and how
    long it lasted."""
    async def run() -> tuple[frozenset[str], float]:
        started = time.monotonic()
        pause = asyncio.ensure_future(_next_tick(store, asyncio.Event(), leading, waited))
        await asyncio.sleep(after_s)
        store.report_use("gateway-1", {"m": Use(waiting=1)})
        seen = await pause
        return seen, time.monotonic() - started
    return asyncio.run(run())


def test_a_new_wait_ends_the_pause_at_once(store: Store) -> None:
    seen, took = pause_with_a_wait_after(store, leading=True, after_s=0.2)
    assert seen == {"m"}
    assert took < 0.6, f"the pause lasted {took:.2f} s after a wait began at 0.2 s"


def test_negative_control_a_model_already_waited_for_waits_for_the_tick(
        store: Store) -> None:
    """m waited for at the tick (the tick placed it): its row, rewritten, is no news."""
    store.report_use("gateway-1", {"m": Use(waiting=1)})
    seen, took = pause_with_a_wait_after(store, leading=True, after_s=0.2,
                                         waited=frozenset({"m"}))
    assert seen == {"m"} and took >= 0.95, took


def test_negative_control_a_control_plane_that_does_not_schedule_looks_at_nothing(
        store: Store) -> None:
    seen, took = pause_with_a_wait_after(store, leading=False, after_s=0.2)
    assert seen == frozenset() and took >= 0.95, (seen, took)
