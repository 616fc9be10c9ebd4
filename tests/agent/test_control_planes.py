"""Which control plane a node beats to: its home by rendezvous hashing of its node id over
the learned URLs, the same after a restart; a third control plane takes about a third of
the nodes and moves no other; a node away from its home returns after its own delay."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from llmgw.agent.control_planes import (
    RETRY_HOME_S,
    RETURN_SPREAD_S,
    ControlPlanes,
    rendezvous,
    return_delay_s,
)

A, B, C = "https://cp-a:7443", "https://cp-b:7443", "https://cp-c:7443"
NODES = [f"node-{i:05d}" for i in range(3000)]

Picker = Callable[[str, list[str]], str]


def _home(node: str, urls: list[str]) -> str:
    return rendezvous(node, urls)[0]


def _modulo(node: str, urls: list[str]) -> str:
    """The naive stable hash: the node's digest modulo the count (what the test rules out)."""
    return urls[int(hashlib.sha256(node.encode()).hexdigest(), 16) % len(urls)]


def _moved(pick: Picker, before: list[str], after: list[str]) -> tuple[float, Counter[str]]:
    """The share of NODES whose pick changed from before to after, and where they went."""
    went = Counter(pick(n, after) for n in NODES if pick(n, before) != pick(n, after))
    return sum(went.values()) / len(NODES), went


def _assert_a_third_moved_all_to_the_new_one(pick: Picker) -> None:
    __tracebackhide__ = True
    share, went = _moved(pick, [A, B], [A, B, C])
    assert 0.28 <= share <= 0.39, f"{share:.1%} of the nodes moved when a third joined"
    assert set(went) == {C}, f"nodes moved between the old control planes: {went}"


def test_n_control_planes_each_carry_about_one_nth() -> None:
    for urls in ([A, B], [A, B, C]):
        counts = Counter(_home(n, urls) for n in NODES)
        expected = len(NODES) / len(urls)
        assert set(counts) == set(urls), counts
        assert all(abs(c - expected) <= 0.1 * expected for c in counts.values()), counts
    # Negative control: a home picked from agent.yaml's server alone (the old way).
    alone = Counter(_home(n, [A]) for n in NODES)
    assert alone == {A: len(NODES)}


def test_adding_a_third_control_plane_moves_about_a_third_of_the_nodes() -> None:
    _assert_a_third_moved_all_to_the_new_one(_home)
    # And when it leaves, only its nodes move, each back to where it was.
    assert all(_home(n, [A, B]) == _home(n, [A, B, C]) or _home(n, [A, B, C]) == C
               for n in NODES)
    # Negative control: modulo hashing moves about two thirds, between the old ones too.
    share, went = _moved(_modulo, [A, B], [A, B, C])
    assert share > 0.5 and set(went) != {C}, (share, went)
    try:
        _assert_a_third_moved_all_to_the_new_one(_modulo)
    except AssertionError:
        pass
    else:
        raise AssertionError("the check did not catch modulo hashing")


# Run in a new interpreter: the homes of NODES[:200], learned into (first run) or read from
# (later runs) the state dir argv[1], as JSON; argv[2] "salted" picks by Python's hash().
_HOMES = """
import json, sys
from pathlib import Path
from llmgw.agent.control_planes import ControlPlanes
homes = {}
for node in [f"node-{i:05d}" for i in range(200)]:
    planes = ControlPlanes("https://cp-a:7443", Path(sys.argv[1]) / node, node)
    if not planes.learned:
        planes.learn({"control_planes": ["https://cp-a:7443", "https://cp-b:7443",
                                         "https://cp-c:7443"]})
    if sys.argv[2] == "salted":
        homes[node] = max(planes.learned, key=lambda u: hash((u, node)))
    else:
        homes[node] = planes.home
print(json.dumps(homes))
"""


def _homes_in_a_new_agent(state: Path, seed: int, how: str = "rendezvous") -> dict[str, str]:
    env = {**os.environ, "PYTHONHASHSEED": str(seed)}
    done = subprocess.run([sys.executable, "-c", _HOMES, str(state), how], env=env,
                          capture_output=True, text=True, timeout=120, check=True)
    homes: dict[str, str] = json.loads(done.stdout)
    return homes


def test_the_home_a_node_picks_is_the_same_after_an_agent_restart(tmp_path: Path) -> None:
    """Each run is a new process with another string-hash salt, as a restarted agent is:
    the second reads what the first learned from its state dir and picks the same homes."""
    first = _homes_in_a_new_agent(tmp_path / "state", seed=1)
    again = _homes_in_a_new_agent(tmp_path / "state", seed=2)
    assert len(set(first.values())) == 3, "every control plane is somebody's home"
    assert again == first
    assert all(ControlPlanes(A, tmp_path / "state" / n, n).current == A for n in first), (
        "a restart reads where it beat; nothing moved yet")
    # Negative control: homes picked with Python's hash(), salted per process, change.
    salted = _homes_in_a_new_agent(tmp_path / "state", seed=1, how="salted")
    resalted = _homes_in_a_new_agent(tmp_path / "state", seed=2, how="salted")
    assert salted != resalted, "the comparison would not have caught an unstable pick"


def test_failover_goes_to_the_next_in_the_node_s_rendezvous_order(tmp_path: Path) -> None:
    planes = ControlPlanes(A, tmp_path, "node-00007")
    planes.learn({"control_planes": [A, B, C]})
    order = planes.order
    assert sorted(order) == [A, B, C] and planes.home == order[0]
    assert planes.next_after(order[0]) == order[1] and planes.next_after(order[2]) == order[0]
    # Once its home leaves the list, the node's home is the one it failed over to.
    planes.learn({"control_planes": [u for u in [A, B, C] if u != order[0]]})
    assert planes.home == order[1]
    # agent.yaml's server, no longer in the list, is still tried, last.
    planes.learn({"control_planes": [B, C]})
    assert planes.order == [*rendezvous("node-00007", [B, C]), A]


def _returns(spread_s: float) -> list[float]:
    """When each of 1,000 nodes, at B, whose home C just joined, moves home (a beat a
    second from t=0, when it learned the list), in seconds."""
    at = []
    for node in NODES[:1000]:
        planes = ControlPlanes(A, "/nonexistent", node, spread_s=spread_s)
        planes.learned = [A, B, C]
        if planes.home != C:
            continue
        planes.current = B
        t = 0.0
        while planes.due_home(t) is None:
            t += 1.0
        at.append(t)
    return at


def test_nodes_return_to_a_control_plane_over_a_minute_not_at_once() -> None:
    at = _returns(RETURN_SPREAD_S)
    per_10s = Counter(int(t // 10) for t in at)
    # Beats a second apart: the last returns at its first beat at or after its delay.
    assert max(at) <= RETURN_SPREAD_S and set(range(6)) <= set(per_10s) <= set(range(7)), \
        per_10s
    assert max(per_10s.values()) <= 0.25 * len(at), f"a burst: {per_10s}"
    assert all(0 <= return_delay_s(n) < RETURN_SPREAD_S for n in NODES)
    # Negative control: without the spread every node moves at its first beat.
    burst = Counter(int(t // 10) for t in _returns(0.0))
    assert burst == {0: len(at)}


def test_a_home_that_failed_is_tried_again_after_a_minute_or_once_it_comes_back(
        tmp_path: Path) -> None:
    node = next(n for n in NODES if _home(n, [A, B]) == A and 1 < return_delay_s(n) < 10)
    planes = ControlPlanes(A, tmp_path, node)
    planes.learn({"control_planes": [A, B]})
    delay = planes.return_delay_s
    planes.left(A, 100.0)
    planes.use(B)
    assert planes.due_home(100.0 + delay + 1) is None, "a home that just failed is left"
    assert planes.due_home(100.0 + RETRY_HOME_S + delay) == A, "tried again after a minute"
    # It leaves the answers' list (its row went stale) and comes back: the spread counts
    # from its return, not from the failure.
    planes.learn({"control_planes": [B]})
    assert planes.home == B and planes.due_home(130.0) is None
    planes.learn({"control_planes": [A, B]})
    assert planes.due_home(131.0) is None
    assert planes.due_home(131.0 + delay) == A
