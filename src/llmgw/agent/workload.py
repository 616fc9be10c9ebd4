"""The seam between the agent's heartbeat and the replicas it runs.

Every heartbeat the agent calls `report()` and sends the result as `replicas` in its
body, then hands the control plane's answer (`replicas`: the assignments for this node)
to `reconcile()`. `run_agent` gives the agent the replica supervisor
(`llmgw.agent.replicas`); `NoReplicas` runs nothing, for an agent built without one (tests).
"""

from __future__ import annotations

from typing import Any, Protocol


class Workload(Protocol):
    def report(self) -> list[dict[str, Any]]:
        """The states of the replicas this node runs, as sent in the heartbeat's `replicas`."""

    def facts(self) -> dict[str, Any]:
        """Top-level heartbeat keys beside `replicas` (state-change counts, log tails)."""

    def reconcile(self, assignments: list[dict[str, Any]]) -> None:
        """Make the running replicas match the control plane's assignments for this node."""


class NoReplicas:
    """Runs nothing and reports nothing; assignments are ignored (remembered for tests)."""

    def __init__(self) -> None:
        self.assignments: list[dict[str, Any]] = []

    def report(self) -> list[dict[str, Any]]:
        return []

    def facts(self) -> dict[str, Any]:
        return {}

    def reconcile(self, assignments: list[dict[str, Any]]) -> None:
        self.assignments = list(assignments)
