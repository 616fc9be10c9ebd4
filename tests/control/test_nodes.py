"""A node's state from its last heartbeat: silence counted while the control plane listens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmgw.contract.records import NodeRecord
from llmgw.control.nodes import Hearing, node_view, silence_s
from llmgw.store import Store

TIMEOUT_S = 30.0


def stored(last_seen: float, **inventory: Any) -> NodeRecord:
    return {"id": "n1", "inventory": {"engines": ["llamacpp"], **inventory},
            "first_seen": 0.0, "last_seen": last_seen, "serial": ""}


def test_without_a_restart_silence_counts_from_the_last_beat() -> None:
    assert silence_s(100.0, 140.0, TIMEOUT_S) == 40.0
    assert node_view(stored(100.0), 140.0, TIMEOUT_S)["state"] == "not_ready"
    assert node_view(stored(100.0), 129.0, TIMEOUT_S)["state"] == "ready"


def test_after_a_restart_silence_counts_from_the_start() -> None:
    """The control plane was down from 105 to 150: its nodes could not beat to it."""
    restart = Hearing(since=150.0, last_before=104.0)
    assert silence_s(100.0, 160.0, TIMEOUT_S, restart) == 10.0
    assert node_view(stored(100.0), 160.0, TIMEOUT_S, restart)["state"] == "ready"
    # Negative control: the same node, the same moment, read without the restart.
    assert node_view(stored(100.0), 160.0, TIMEOUT_S)["state"] == "not_ready"


def test_the_grace_lasts_one_node_timeout_from_the_start() -> None:
    restart = Hearing(since=150.0, last_before=104.0)
    assert node_view(stored(100.0), 180.0, TIMEOUT_S, restart)["state"] == "ready"
    assert node_view(stored(100.0), 180.5, TIMEOUT_S, restart)["state"] == "not_ready"


def test_a_beat_after_the_start_counts_from_that_beat() -> None:
    restart = Hearing(since=150.0, last_before=104.0)
    assert silence_s(155.0, 160.0, TIMEOUT_S, restart) == 5.0
    assert node_view(stored(155.0), 186.0, TIMEOUT_S, restart)["state"] == "not_ready"


def test_a_node_already_silent_before_the_restart_stays_not_ready() -> None:
    """Silent for 40 s when the old control plane last heard anyone: no grace for it."""
    restart = Hearing(since=150.0, last_before=104.0)
    assert silence_s(64.0, 151.0, TIMEOUT_S, restart) == 87.0
    assert node_view(stored(64.0), 151.0, TIMEOUT_S, restart)["state"] == "not_ready"


def test_a_store_opened_again_knows_the_newest_beat_before_it(tmp_path: Path) -> None:
    now = [1000.0]
    first = Store(tmp_path / "db", clock=lambda: now[0])
    assert first.hearing == Hearing(since=1000.0, last_before=float("-inf"))
    first.heartbeat("n1", {}, "", {})
    now[0] = 1003.0
    first.heartbeat("n2", {}, "", {})
    first.close()
    now[0] = 1100.0
    again = Store(tmp_path / "db", clock=lambda: now[0])
    try:
        assert again.hearing == Hearing(since=1100.0, last_before=1003.0)
        views = {n["id"]: node_view(n, 1110.0, TIMEOUT_S, again.hearing)["state"]
                 for n in again.nodes()}
        assert views == {"n1": "registering", "n2": "registering"}
    finally:
        again.close()
