"""The records that cross a boundary, as typed dicts: the store's rows, the admin API's
views, the catalog model (defined with its rules in contract.catalog), and the heartbeat
with its answer.

They are TypedDicts, not models, so every reader keeps plain dicts (JSON in, JSON out);
pydantic's TypeAdapters check them at the store's boundary and give the admin API its
OpenAPI shapes. An inventory is an agent's heartbeat, untrusted input: its known keys are
typed, and keys a newer agent adds are kept as sent.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired, TypeVar, cast

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError, with_config
from typing_extensions import TypedDict

from llmgw.contract import REPORTED_REPLICA_STATES, NodeState, ReplicaState
from llmgw.contract.catalog import Geometry as Geometry
from llmgw.contract.catalog import ModelSpec as ModelSpec
from llmgw.contract.catalog import ProfileSpec as ProfileSpec
from llmgw.contract.catalog import ScalingSpec as ScalingSpec
from llmgw.contract.explain import problems
from llmgw.errors import Error

T = TypeVar("T")
_OPEN = ConfigDict(extra="allow")
_CLOSED = ConfigDict(extra="forbid")


# "class" is a Python keyword, so this record takes the functional form.
# A MIG instance is an entry of its own: its uuid is "MIG-…", mig_parent its GPU's UUID
# (a GPU in MIG mode is not listed itself); unknown names what NVML could not read.
# memory_free_mb and memory_used_mb are read from NVML at each heartbeat; error is NVML's
# reason where the card stopped answering at that beat ("" while it answers). An older
# agent sends neither memory_used_mb nor error, and its free memory as at its start.
Gpu = TypedDict("Gpu", {"index": int, "name": str, "memory_mb": int, "uuid": str,
                        "class": str, "memory_free_mb": int, "compute_capability": str,
                        "mig_parent": str, "unknown": list[str], "memory_used_mb": int,
                        "error": str}, total=False)
# What with_config does, spelled so a type checker still sees a TypedDict.
Gpu.__pydantic_config__ = _OPEN  # type: ignore[attr-defined]


@with_config(_OPEN)
class EngineStatus(TypedDict, total=False):
    engine: str
    version: str
    # Not EngineState: a newer agent may report a state this release does not know.
    state: str
    detail: str
    # The GPU engine's check, card by card: the NVML UUIDs that passed it (the scheduler
    # places GPU replicas on these alone; absent from an older agent: every card), and
    # those left out, with why.
    gpus: list[str]
    left_out: dict[str, str]


@with_config(_OPEN)
class GivenUp(TypedDict, total=False):
    """A GPU placement a node gave up on (agent/replicas/supervisor.py, GPU_START_ATTEMPTS
    failed starts in a row): its replica, model, profile and GPUs, why (the engine's log),
    how many starts, each card's free memory (MiB) as it then was, and since when (unix
    seconds). The node reports it for GIVE_UP_FOR_S; the scheduler places no replica of that
    model and profile on those cards meanwhile, unless a card's free memory grew by
    GIVE_UP_FREE_GROWTH_MB."""

    replica: str
    model: str
    profile: str
    gpus: list[str]
    reason: str
    starts: int
    free_mb: dict[str, int]
    since: float


@with_config(_CLOSED)
class StateChanges(TypedDict, total=False):
    """How often a replica entered each state (for llmgw_replica_state_changes_total)."""

    model: str
    to: dict[str, int]


@with_config(_OPEN)
class Inventory(TypedDict, total=False):
    """What a node's last heartbeat said about it (Heartbeat below), as stored."""

    claimed_id: str
    # The id of the control plane that received the beat (the agent API sets it).
    control_plane: str
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
    given_up: list[GivenUp]
    # Whether this node's ready engine has llama.cpp's RPC backend (rpc-server beside
    # llama-server, and --rpc): only such nodes take part in a replica split over nodes.
    rpc: bool
    # Which of its ready engines have it (llamacpp, llamacpp-cuda): a GPU split takes only
    # nodes whose GPU engine has it. An older agent sends `rpc` alone, for its CPU engine.
    rpc_engines: list[str]


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
    # The id of the control plane its last heartbeat went to ("" from an older one).
    control_plane: NotRequired[str]
    # GPU placements this node gave up on (GivenUp), while it reports them.
    given_up: NotRequired[list[GivenUp]]
    # Its inventory's `rpc`: whether it may take part in a replica split over nodes.
    rpc: NotRequired[bool]
    # Its inventory's `rpc_engines`: the engines of it that may (a GPU split needs the GPU
    # engine's).
    rpc_engines: NotRequired[list[str]]


@with_config(_CLOSED)
class SplitWorker(TypedDict):
    """One worker of a replica split over nodes (control/_split.py places it): the layers
    it holds, and once it reported its relay (agent/rpc_relay.py), where the main node
    reaches it. addr is the worker's management address (its inventory's `addr`), port its
    relay's: '' and 0 until the worker has reported. state and err are the worker's last
    report on its share ('' before any). gpus: for a GPU profile, the worker's cards (NVML
    UUIDs, in its order) that its rpc-server serves and the replica holds; its layers are
    shared evenly over them. Absent or empty: a CPU share."""

    node: str
    layers: int
    addr: str
    port: int
    gpus: NotRequired[list[str]]
    state: NotRequired[str]
    err: NotRequired[str]


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
    # The NVML UUIDs (GPUs or MIG instances, in order) the scheduler gave a GPU profile:
    # one card, or the cards one replica is split over (its profile's `gpus`), in the
    # order the engine numbers them. A live replica holds every card listed here.
    gpus: NotRequired[list[str]]
    # A replica split over nodes (its profile's `nodes`): `node` is its main node, these
    # its workers in the order the main engine numbers its RPC devices. Absent or empty
    # for a replica on one node. The replica counts against every node listed.
    workers: NotRequired[list[SplitWorker]]
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
    gpus: list[str]
    # A worker's report on its share of a split replica (ReplicaReport.relay_port): the
    # store puts it in that worker's entry of `workers`, never in a column of its own.
    relay_port: int


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
    gpus: NotRequired[list[str]]
    # A replica split over nodes: its workers (`node` is its main node), each with its
    # layers and its last report.
    workers: NotRequired[list[SplitWorker]]
    # Why it runs on its profile and not a better one of its model on its node (a GPU
    # profile's card too full, taken or lost, the GPU engine not ready): "" on its best.
    # Worked out when asked (control.scheduler.held_back), not stored.
    held_back: NotRequired[str]


# The states an agent may report of a replica it runs (REPORTED_REPLICA_STATES): pending
# and stopped are the scheduler's alone.
ReportedState = Literal[ReplicaState.DOWNLOADING, ReplicaState.STARTING, ReplicaState.READY,
                        ReplicaState.FAILED]


def reported(state: ReplicaState) -> ReportedState:
    """state as a heartbeat may carry it; ValueError for one only the scheduler gives."""
    if state not in REPORTED_REPLICA_STATES:
        raise ValueError(f"a replica's agent does not report {state!r}: it is the "
                         "scheduler's")
    return cast(ReportedState, state)


class ReplicaReport(TypedDict):
    """What an agent says of one replica it runs, in its heartbeat's `replicas`."""

    id: str
    state: ReportedState
    # "" (or absent) until there is one: a replica still downloading has no endpoint.
    err: NotRequired[str]
    endpoint: NotRequired[str]
    api_key: NotRequired[str]
    pid: NotRequired[int]
    # A worker's share of a split replica: the port its relay listens on (on its
    # management address) once rpc-server and the relay are up.
    relay_port: NotRequired[int]


class ReplicaReports(TypedDict):
    """A heartbeat's `replicas`, as the agent API checks them (apart from the inventory)."""

    replicas: list[ReplicaReport]


class Heartbeat(Inventory, total=False):
    """An agent's heartbeat body: its inventory, the id it believes it has (the certificate
    decides) and its replicas."""

    node_id: str
    replicas: list[ReplicaReport]


class NodeReplica(ReplicaRecord):
    """A node's replica row as a heartbeat reads it, with its model (None when deleted).
    share: on a worker of a split replica, its own entry of `workers` (the row's node is
    the main node); absent on the replica's own node."""

    spec: ModelSpec | None
    share: NotRequired[SplitWorker]


class Assignment(TypedDict):
    """A replica the control plane wants a node to run: what the agent starts it with."""

    id: str
    model: str
    profile: str
    engine: str
    gpu_class: str
    source: str
    sha256: str
    args: list[str]
    # The GPUs to run on (NVML UUIDs, in order): empty or absent for a CPU profile; more
    # than one: one engine split layer by layer over them.
    gpus: NotRequired[list[str]]
    # A replica split over nodes: this node's part in it (absent for a replica on one node).
    split: NotRequired[SplitMain | SplitShare]


class SplitMain(TypedDict):
    """To the main node of a split replica: its engine runs with `--rpc` to these workers
    (through the relay's loopback ports), their layers on them and the rest on itself. Sent
    only once every worker has reported its relay (each port > 0)."""

    role: Literal["main"]
    workers: list[SplitWorker]
    # The model's layers the main node keeps (its own cards share them evenly, after the
    # workers' devices in --tensor-split); absent from an older control plane.
    layers: NotRequired[int]


class SplitShare(TypedDict):
    """To a worker of a split replica: run rpc-server for it (its layers' weights come from
    the main node over RPC) behind a relay that admits the certificate of `main` alone, and
    report the relay's port (ReplicaReport.relay_port)."""

    role: Literal["worker"]
    main: str
    layers: int


class HeartbeatAnswer(TypedDict):
    """The agent API's answer to a heartbeat; `mirror` only when the control plane has one.

    control_planes: the agent API URLs (https://HOST:PORT) of every live control plane of
    the fleet, this one included; the agent moves to another when its own stops answering.
    An older control plane sends none, and the agent keeps the list it had.

    revision: a digest of exactly these replicas, for the watch (AgentPaths.WATCH); an
    older control plane sends none, and the agent only beats."""

    node_id: str
    replicas: list[Assignment]
    mirror: NotRequired[str]
    control_planes: NotRequired[list[str]]
    revision: NotRequired[str]


class WatchAnswer(TypedDict):
    """The answer to a held watch: changed when the node's assignments differ from the
    revision it sent (it should beat now), else unchanged after the hold; revision is the
    one they have now."""

    changed: bool
    revision: str


class JoinToken(TypedDict):
    token: str
    expires: float


class NodeRemoval(TypedDict):
    id: str
    revoked: list[str]


class ReplicaLog(TypedDict):
    replica: str
    node: str
    lines: list[str]


class PublicKey(TypedDict):
    """A gateway key as the admin API and `llmgw keys ls` show it: never its hash. models
    empty: every model; rpm/tpm 0: no limit; usage is flushed by the gateway in batches."""

    id: str
    name: str
    prefix: str
    models: list[str]
    rpm: int
    tpm: int
    expires: float | None
    created: float
    revoked: float | None
    last_used: float | None
    requests: int
    prompt_tokens: int
    completion_tokens: int


class KeyRecord(PublicKey):
    """A gateway key as stored: with the sha256 of its secret (the secret is never kept)."""

    hash: str


class NewKey(PublicKey):
    """The answer to making a key: the one place its secret shows."""

    key: str


class DriftFailure(TypedDict):
    """A promise that fails on a host, since when (unix seconds), and why."""

    promise: Annotated[str, Field(max_length=200)]
    since: float
    message: Annotated[str, Field(default="", max_length=4000)]


class DriftReport(TypedDict):
    """A host's last round of `llmgw check --serve`, as it sends it to the control plane
    (DRIFT_REPORT checks it there)."""

    checked: float
    promises: Annotated[int, Field(ge=0)]
    failing: Annotated[list[DriftFailure], Field(default_factory=list, max_length=1000)]


class HostDrift(DriftReport):
    """A host's drift as the control plane holds it (`llmgw status`)."""

    host: str
    received: float


class DownloadStatus(TypedDict):
    """How far the mirror has one model version: percent only while downloading."""

    state: str
    bytes: int
    total: int | None
    # None until the source states a digest or the bytes are whole.
    sha256: str | None
    err: str
    percent: int | None


class MirrorVersion(TypedDict):
    """A model version in the mirror, as its management API shows it; url is where nodes
    download it."""

    model: str
    version: str
    url: str
    status: DownloadStatus


class CheckRecord(TypedDict):
    """One promise's verdict, as `llmgw check --json` prints it (one object a line)."""

    step: str
    promise: str
    status: str
    message: str


INVENTORY: TypeAdapter[Inventory] = TypeAdapter(Inventory)
REPLICA: TypeAdapter[ReplicaRecord] = TypeAdapter(ReplicaRecord)
REPLICA_UPDATE: TypeAdapter[ReplicaUpdate] = TypeAdapter(ReplicaUpdate)
REPORTS: TypeAdapter[ReplicaReports] = TypeAdapter(ReplicaReports)
DRIFT_REPORT: TypeAdapter[DriftReport] = TypeAdapter(DriftReport)


class RecordError(Error, ValueError):
    """A record the store refuses; the message names each bad key and what it allows."""


def explain(e: ValidationError, what: str) -> str:
    """`WHAT refused: KEY is FOUND: WHY; ...` (contract.explain, the one explainer)."""
    return f"{what} refused: {problems(e)}"


def checked(adapter: TypeAdapter[T], value: Any, what: str) -> T:
    """value as adapter validates it, or RecordError naming what is wrong."""
    try:
        return adapter.validate_python(value)
    except ValidationError as e:
        raise RecordError(explain(e, what)) from None


class ControlPlane(TypedDict):
    """A control plane sharing the store, as it last beat its row (unix seconds)."""

    id: str
    agent_url: str
    admin_url: str
    started: float
    last_seen: float


class ControlPlaneView(ControlPlane):
    """A control plane as GET /api/v1/control-planes shows it: scheduling is true for the
    one holding the scheduler lease unexpired, epoch that lease's epoch (0 for the others)."""

    scheduling: bool
    epoch: int


class PublicViewer(TypedDict):
    """A viewer key as the admin API shows it (never its hash): it reads the fleet (the
    admin API's GETs, the fleet page) and changes nothing."""

    id: str
    name: str
    prefix: str
    created: float
    revoked: float | None
    # When it stops working (unix seconds); None: never.
    expires: float | None


class ViewerRecord(PublicViewer):
    """A viewer key as stored: with the sha256 of the key (the key is never kept)."""

    hash: str


class NewViewer(PublicViewer):
    """The answer to making a viewer key: the one place its secret shows."""

    key: str


class SessionRecord(TypedDict):
    """A fleet-page session as the store keeps it: by the sha256 of its cookie (never the
    cookie), who it speaks for, the sha256 of the credential it signed in with, until
    expires. viewer_live and viewer_expires are its viewer key's, read with it (a session
    of the admin token: True and None)."""

    hash: str
    role: str
    name: str
    credential: str
    created: float
    expires: float
    viewer_live: bool
    viewer_expires: float | None
