"""The contract between the control plane, the agent and the harness: states and paths.

Everything that crosses a process boundary is named here once: a replica's, a node's and
an engine's states, and the agent and admin APIs' URL paths. The agent imports nothing of
the control plane but this package.
"""

from llmgw.contract.paths import AdminPaths, AgentPaths
from llmgw.contract.states import (
    CPU_ENGINE,
    CUDA_ENGINE,
    ENGINE_GAVE_UP,
    ENGINE_NOT_WANTED,
    GIVE_UP_FREE_GROWTH_MB,
    LIVE_REPLICA_STATES,
    REPORTED_REPLICA_STATES,
    EngineState,
    ModelState,
    NodeState,
    ReplicaState,
    model_state,
)

__all__ = [
    "CPU_ENGINE",
    "CUDA_ENGINE",
    "ENGINE_GAVE_UP",
    "ENGINE_NOT_WANTED",
    "GIVE_UP_FREE_GROWTH_MB",
    "LIVE_REPLICA_STATES",
    "REPORTED_REPLICA_STATES",
    "AdminPaths",
    "AgentPaths",
    "EngineState",
    "ModelState",
    "NodeState",
    "ReplicaState",
    "model_state",
]
