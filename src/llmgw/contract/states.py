"""The states of replicas, nodes and engines: one spelling each, shared by every process.

They are StrEnums: a member equals its text ("ready"), so stored rows, JSON bodies and
metric labels carry the plain word, and code compares against the member.
"""

from __future__ import annotations

from enum import StrEnum


class ReplicaState(StrEnum):
    """Where one replica of a catalog model is: placed by the scheduler, then reported by
    its node's agent, until the scheduler stops it."""

    PENDING = "pending"
    DOWNLOADING = "downloading"
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"


class ModelState(StrEnum):
    """A catalog model as its replicas show it: none live (a model at scaling.min 0 loads
    on its first request), live but none ready yet, or at least one ready."""

    IDLE = "idle"
    LOADING = "loading"
    SERVING = "serving"


def model_state(states: list[str]) -> ModelState:
    """A model's state from its replicas' states (stopped ones included or not)."""
    live = [s for s in states if s != ReplicaState.STOPPED]
    if any(s == ReplicaState.READY for s in live):
        return ModelState.SERVING
    return ModelState.LOADING if live else ModelState.IDLE


class NodeState(StrEnum):
    """A node as its heartbeats show it: registered, provisioning its engine, ready with it,
    or silent for longer than node_timeout_s."""

    REGISTERING = "registering"
    PROVISIONING = "provisioning"
    READY = "ready"
    NOT_READY = "not_ready"


class EngineState(StrEnum):
    """A node's engine as its agent provisions it (found, downloaded, built, checked).

    The GPU engine (llamacpp-cuda) also has two states of its own: absent (this node has
    no NVIDIA GPU) and switched_off (engine.cuda: off in agent.yaml)."""

    ABSENT = "absent"
    SWITCHED_OFF = "switched_off"
    PENDING = "pending"
    DOWNLOADING = "downloading"
    BUILDING = "building"
    CHECKING = "checking"
    READY = "ready"
    FAILED = "failed"
    UNSUPPORTED = "unsupported"


# The engines a node reports, each on its own: llama.cpp for the CPU, and llama.cpp built
# with CUDA, which a node with NVIDIA GPUs makes in the background while the first serves.
CPU_ENGINE = "llamacpp"
CUDA_ENGINE = "llamacpp-cuda"

# A replica the scheduler counts: placed or running somewhere, not yet stopped.
LIVE_REPLICA_STATES = frozenset(ReplicaState) - {ReplicaState.STOPPED}
# What an agent may report of its own replicas; pending and stopped are the scheduler's.
REPORTED_REPLICA_STATES = frozenset({ReplicaState.DOWNLOADING, ReplicaState.STARTING,
                                     ReplicaState.READY, ReplicaState.FAILED})
# An engine its agent gave up on until the agent starts again: broken, or not to be had here.
ENGINE_GAVE_UP = frozenset({EngineState.FAILED, EngineState.UNSUPPORTED})
# An engine that will not be made here, by design: nothing to wait for or warn about.
ENGINE_NOT_WANTED = frozenset({EngineState.ABSENT, EngineState.SWITCHED_OFF})

# A GPU placement its node gave up on (agent/replicas/supervisor.py) is tried again before the node
# stops reporting it (GIVE_UP_FOR_S there) once its card's free memory, as the heartbeat
# reports it, has grown by this much (MiB) since: the scheduler's rule, the agent's warning.
GIVE_UP_FREE_GROWTH_MB = 1024
