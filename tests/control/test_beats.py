"""Two control planes on one store: a node beating to one, unchanged, is written again
within a third of the beating control plane's node timeout, so the other never shows it
not ready; and the one it beats to shows its newest beat at once."""

from __future__ import annotations

from pathlib import Path

from llmgw.control.agent_api import AgentAPI
from llmgw.control.nodes import node_view
from llmgw.store import Store

INVENTORY = {"cpus": 2, "engines": ["llamacpp"], "labels": {"zone": "a"}}


class Clock:
    def __init__(self) -> None:
        self.now = 5000.0

    def __call__(self) -> float:
        return self.now


def states_seen(tmp_path: Path, beating_timeout_s: float, watching_timeout_s: float,
                ) -> tuple[set[str], set[str]]:
    """A node beats every second for four node timeouts to a control plane with
    beating_timeout_s; the states it and another one (watching_timeout_s) showed."""
    clock = Clock()
    beating = Store(tmp_path / f"control-{beating_timeout_s}.db", clock=clock)
    watching = Store(tmp_path / f"control-{beating_timeout_s}.db", clock=clock)
    api = AgentAPI(beating, node_timeout_s=beating_timeout_s)
    here, there = set(), set()
    try:
        for _ in range(int(4 * watching_timeout_s)):
            api.heartbeat("node-a", INVENTORY)
            mine = beating.node("node-a")
            assert mine is not None and mine["last_seen"] == clock.now, \
                "the control plane a node beats to shows that beat at once"
            here.add(node_view(mine, clock.now, beating_timeout_s)["state"])
            theirs = watching.node("node-a")
            assert theirs is not None
            there.add(node_view(theirs, clock.now, watching_timeout_s)["state"])
            clock.now += 1.0
    finally:
        beating.close()
        watching.close()
    return here, there


def test_another_control_plane_sees_a_node_beating_unchanged_ready(tmp_path: Path) -> None:
    assert states_seen(tmp_path, 8.0, 8.0) == ({"ready"}, {"ready"})


def test_negative_control_a_longer_timeout_there_than_here_loses_the_node(
        tmp_path: Path) -> None:
    """The beating control plane rewrites every third of its own timeout (at most
    store.nodes.REWRITE_EVERY_S): one whose node timeout is shorter than that loses it."""
    here, there = states_seen(tmp_path, 60.0, 5.0)
    assert here == {"ready"} and "not_ready" in there
