"""The seam between the agent's heartbeat and the replicas it runs.

Every heartbeat the agent calls `report()` and sends the result as `replicas` in its
body, then hands the control plane's answer (`replicas`: the assignments for this node)
to `reconcile()`. `run_agent` gives the agent the replica supervisor
(`llmgw.agent.replicas.supervisor`); `NoReplicas` runs nothing, for an agent built without
one (tests).
"""

from __future__ import annotations

from typing import Protocol

from llmgw.contract.records import Assignment, Inventory, ReplicaReport


class Workload(Protocol):
    def report(self) -> list[ReplicaReport]:
        """The states of the replicas this node runs, as sent in the heartbeat's `replicas`."""

    def facts(self) -> Inventory:
        """Top-level heartbeat keys beside `replicas` (state-change counts, log tails)."""

    def reconcile(self, assignments: list[Assignment]) -> None:
        """Make the running replicas match the control plane's assignments for this node."""

    def warnings(self) -> list[str]:
        """What a person must read of the replicas (a GPU placement given up), one line each."""

    def loading(self) -> bool:
        """Whether a replica is downloading or starting (the agent beats sooner meanwhile,
        so that a ready engine is served at once)."""


class NoReplicas:
    """Runs nothing and reports nothing; assignments are ignored (remembered for tests)."""

    def __init__(self) -> None:
        self.assignments: list[Assignment] = []

    def report(self) -> list[ReplicaReport]:
        return []

    def facts(self) -> Inventory:
        return {}

    def reconcile(self, assignments: list[Assignment]) -> None:
        self.assignments = list(assignments)

    def warnings(self) -> list[str]:
        return []

    def loading(self) -> bool:
        return False
