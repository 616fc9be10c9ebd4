"""The store's records as typed dicts: validated going in and coming out, dicts to readers.

They are TypedDicts, not models, so the scheduler, gateway, metrics and agent API keep
reading them as dicts; pydantic's TypeAdapters check them at the store's boundary and give
the admin API its OpenAPI shapes. An inventory is an agent's heartbeat, untrusted input:
its known keys are typed, and keys a newer agent adds are kept as sent.
"""

from __future__ import annotations

from typing import Any, NotRequired

from pydantic import ConfigDict, TypeAdapter, ValidationError, with_config
from typing_extensions import TypedDict

from llmgw.contract import NodeState, ReplicaState

_OPEN = ConfigDict(extra="allow")
_CLOSED = ConfigDict(extra="forbid")


# "class" is a Python keyword, so this record takes the functional form.
Gpu = with_config(_OPEN)(TypedDict("Gpu", {"index": int, "name": str, "memory_mb": int,
                                           "uuid": str, "class": str}, total=False))


@with_config(_OPEN)
class EngineStatus(TypedDict, total=False):
    engine: str
    version: str
    # Not EngineState: a newer agent may report a state this release does not know.
    state: str
    detail: str


@with_config(_CLOSED)
class StateChanges(TypedDict, total=False):
    """How often a replica entered each state (for llmgw_replica_state_changes_total)."""

    model: str
    to: dict[str, int]


@with_config(_OPEN)
class Inventory(TypedDict, total=False):
    """What a node's last heartbeat said about it (DESIGN.md), as stored."""

    claimed_id: str
    gpus: list[Gpu]
    cpus: int
    memory_mb: int
    labels: dict[str, str]
    engines: list[str]
    provision: list[EngineStatus]
    interface: str
    addr: str
    warnings: list[str]
    replica_state_changes: dict[str, StateChanges]
    replica_logs: dict[str, list[str]]


class NodeRecord(TypedDict):
    id: str
    inventory: Inventory
    first_seen: float
    last_seen: float
    serial: str


class NodeView(TypedDict):
    """A node as the admin API shows it."""

    id: str
    state: NodeState
    engines: list[str]
    provision: list[EngineStatus]
    gpus: list[Gpu]
    labels: dict[str, str]
    addr: str
    interface: str
    cpus: int
    memory_mb: int
    warnings: list[str]
    last_seen: float


@with_config(_CLOSED)
class ReplicaRecord(TypedDict):
    """A replica row; `updated` is set by the store."""

    id: str
    model: str
    node: str
    profile: str
    state: ReplicaState
    err: NotRequired[str]
    endpoint: NotRequired[str]
    api_key: NotRequired[str]
    updated: NotRequired[float]


@with_config(_CLOSED)
class ReplicaUpdate(TypedDict, total=False):
    """The fields update_replica may change."""

    node: str
    profile: str
    state: ReplicaState
    err: str
    endpoint: str
    api_key: str


class PublicReplica(TypedDict):
    """A replica as the admin API shows it: never its api_key."""

    id: str
    model: str
    node: str
    profile: str
    state: ReplicaState
    err: str
    endpoint: str
    updated: float


INVENTORY: TypeAdapter[Inventory] = TypeAdapter(Inventory)
REPLICA: TypeAdapter[ReplicaRecord] = TypeAdapter(ReplicaRecord)
REPLICA_UPDATE: TypeAdapter[ReplicaUpdate] = TypeAdapter(ReplicaUpdate)


class RecordError(ValueError):
    """A record the store refuses; the message names each bad key and what it allows."""


def explain(e: ValidationError, what: str) -> str:
    """One line per problem: where (dotted key), what was found, what is allowed."""
    lines = [f"{'.'.join(str(p) for p in err['loc']) or '(top)'}: {err['msg']} "
             f"(found {err.get('input')!r})" for err in e.errors()]
    return f"{what} refused: " + "; ".join(lines)


def checked(adapter: TypeAdapter[Any], value: Any, what: str) -> Any:
    """value as adapter validates it, or RecordError naming what is wrong."""
    try:
        return adapter.validate_python(value)
    except ValidationError as e:
        raise RecordError(explain(e, what)) from None
