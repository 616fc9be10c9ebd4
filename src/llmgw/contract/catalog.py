"""A catalog model, defined once: what the admin API takes (`llmgw models add FILE`), the
store keeps and the scheduler and the gateway read, with the rules it must meet to be
served and the defaults of what it may leave out.

The records are TypedDicts, so every reader holds plain dicts; the rules and defaults ride
in their annotations (Annotated, Field), and pydantic checks a new model against them
(CATALOG_MODEL) and gives the admin API its OpenAPI shape. contract.records re-exports
them beside the other records."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, get_type_hints

from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field, TypeAdapter, with_config
from pydantic.fields import FieldInfo
from typing_extensions import TypedDict

from llmgw.contract.states import CPU_ENGINE
from llmgw.model.engine_args import check_engine_args
from llmgw.model.kv_sizing import SPLIT_MODE_FLAGS, TENSOR_SPLIT_FLAGS, arg_value, tensor_split

# A profile names the engine family; a GPU profile runs on its CUDA build (llamacpp-cuda).
ENGINES = (CPU_ENGINE,)
# llama.cpp's most devices (LLAMA_MAX_DEVICES): one replica is split over at most this many.
MAX_CARDS = 16
# The most nodes one replica is split over (llama.cpp's RPC backend): a main and its workers.
MAX_NODES = 8
# No file://: the agent runs as root and would read any file the catalog named.
SOURCE_SCHEMES = ("hf:", "https://", "http://")
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")
_STRICT = ConfigDict(extra="forbid")


def defaults(record: type) -> dict[str, Any]:
    """The keys of a record below that have a default, each with the default its
    annotation declares (a fresh one: lists and dicts are never shared)."""
    found = {}
    for key, hint in get_type_hints(record, include_extras=True).items():
        info = FieldInfo.from_annotation(hint)
        if not info.is_required():
            found[key] = info.get_default(call_default_factory=True)
    return found


def _name_shape(v: str) -> str:
    if not _NAME.match(v):
        raise ValueError(
            f"name {v!r} must be lower-case letters, digits, '.', '_' or '-', "
            "starting with a letter or digit, at most 128 characters"
        )
    return v


def _alias_shape(v: list[str]) -> list[str]:
    for alias in v:
        _name_shape(alias)
    return v


def _source_scheme(v: str) -> str:
    if v.startswith("file:"):
        raise ValueError(
            f"source {v!r} is a file on the control plane's machine, which nodes cannot "
            "read; put it in the mirror with `llmgw mirror import FILE --model M --version "
            "V` and use the URL that prints"
        )
    if not v.startswith(SOURCE_SCHEMES):
        raise ValueError(f"source {v!r} must start with one of {', '.join(SOURCE_SCHEMES)}")
    return v


def _hex_digest(v: str) -> str:
    if v and not re.fullmatch(r"[0-9a-f]{64}", v):
        raise ValueError("sha256 must be 64 lower-case hex digits, or empty when unknown")
    return v


def _known_engine(v: str) -> str:
    if v not in ENGINES:
        raise ValueError(f"engine {v!r} is unknown; llmgw serves {', '.join(ENGINES)}")
    return v


def _allowed_args(v: list[str]) -> list[str]:
    check_engine_args(v)
    return v


@with_config(_STRICT)
class ScalingSpec(TypedDict):
    """How many replicas of a model the scheduler keeps: at least min, at most max. With
    min 0 the model loads on its first request (the gateway holds it meanwhile); a replica
    above min with no request for idle_s seconds is removed (0: never)."""

    min: Annotated[int, Field(default=1, ge=0, le=64)]
    max: Annotated[int, Field(default=1, ge=1, le=64)]
    idle_s: Annotated[int, Field(default=900, ge=0)]


def _min_le_max(v: ScalingSpec) -> ScalingSpec:
    if v["min"] > v["max"]:
        raise ValueError(f"scaling.min ({v['min']}) is above scaling.max ({v['max']})")
    return v


def _card_count(v: object) -> object:
    if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_CARDS):
        return v
    raise ValueError(f"gpus must be a number of cards from 1 to {MAX_CARDS} (at most that "
                     "many, the fewest that fit) or auto (as few as fit of all the node's)")


def _node_count(v: object) -> object:
    if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_NODES):
        return v
    raise ValueError(f"nodes must be a number of nodes from 1 to {MAX_NODES} (1: never split; "
                     "N: one replica over at most N nodes, the fewest that fit, when no single "
                     "node holds it) or auto (as few as fit)")


@with_config(_STRICT)
class ProfileSpec(TypedDict):
    """One way to serve the model: on which engine, what hardware, with which arguments."""

    name: Annotated[str, Field(min_length=1, max_length=64)]
    engine: Annotated[str, AfterValidator(_known_engine)]
    gpu_class: Annotated[str, Field(default="")]
    priority: Annotated[int, Field(default=100, ge=0, le=10_000)]
    min_memory_gb: Annotated[float, Field(default=0, ge=0)]
    node_selector: Annotated[dict[str, str], Field(default_factory=dict)]
    args: Annotated[list[str], AfterValidator(_allowed_args), Field(default_factory=list)]
    # How many of a node's cards one replica may take: at most N (the fewest that fit), or
    # "auto": as many as the node has. More than one splits it layer-wise (control._cards).
    gpus: Annotated[int | Literal["auto"], BeforeValidator(_card_count), Field(default=1)]
    # How many nodes one replica may be split over when no single node holds it (llama.cpp's
    # RPC backend, control._split): 1 never splits; N at most N nodes; "auto" as few as fit.
    nodes: Annotated[int | Literal["auto"], BeforeValidator(_node_count), Field(default=1)]


def cards_wanted(profile: ProfileSpec) -> int:
    """The most cards one replica of profile takes (MAX_CARDS for "auto"); 1 for a row
    stored before profiles said."""
    wanted = profile.get("gpus", 1)
    return MAX_CARDS if wanted == "auto" else int(wanted)


def nodes_wanted(profile: ProfileSpec) -> int:
    """The most nodes one replica of profile is split over (MAX_NODES for "auto"); 1 for a
    row stored before profiles said."""
    wanted = profile.get("nodes", 1)
    return MAX_NODES if wanted == "auto" else int(wanted)


def _split_rules(v: ProfileSpec) -> ProfileSpec:
    wanted, name = v.get("gpus", 1), v["name"]
    if wanted != 1 and not v["gpu_class"]:
        raise ValueError(f"profile {name!r} asks gpus: {wanted} but names no gpu_class; a "
                         "CPU profile runs on the node's CPU: set gpu_class or drop gpus")
    over = v.get("nodes", 1)
    mode = arg_value(v["args"], SPLIT_MODE_FLAGS)
    if over != 1 and v["gpu_class"] and mode and mode != "layer":
        raise ValueError(f"profile {name!r} asks nodes: {over} with --split-mode {mode}; "
                         "llama.cpp's RPC backend shares a model over nodes layer by layer "
                         "only: drop --split-mode or write --split-mode layer")
    if over != 1 and v["gpu_class"] and arg_value(v["args"], TENSOR_SPLIT_FLAGS):
        raise ValueError(f"profile {name!r} asks nodes: {over} with its own --tensor-split; "
                         "split over nodes, llmgw shares the layers out over every node's "
                         "cards by what each gives: drop --tensor-split (it still applies "
                         "to a replica on one node's cards without nodes)")
    if wanted != 1 and mode and mode != "layer":
        raise ValueError(f"profile {name!r} asks gpus: {wanted} with --split-mode {mode}; "
                         "llmgw fits and runs a split layer by layer: drop --split-mode or "
                         "write --split-mode layer")
    given = tensor_split(v["args"])
    if arg_value(v["args"], TENSOR_SPLIT_FLAGS) and (wanted == "auto" or len(given) != wanted):
        raise ValueError(f"profile {name!r} has a --tensor-split of {len(given)} values and "
                         f"gpus: {wanted}; a profile's own split names one proportion a "
                         f"card: write gpus: {len(given) or 'N'} beside it, or drop "
                         "--tensor-split and llmgw splits by each card's free memory")
    return v


_GEOMETRY_KEY = Annotated[int, Field(default=0, ge=0)]


@with_config(_STRICT)
class Geometry(TypedDict, total=False):
    """What a model's KV cache takes, from its GGUF header (`<arch>.` keys): layers, the
    context it was trained for, attention heads (and key/value heads), the embedding and
    feed-forward widths (the compute buffer holds a batch's activations), and the key and
    value widths of a head where the file says them. 0 (or absent, as ggufmeta reads it)
    where the file does not say."""

    block_count: _GEOMETRY_KEY
    context_length: _GEOMETRY_KEY
    head_count: _GEOMETRY_KEY
    head_count_kv: _GEOMETRY_KEY
    embedding_length: _GEOMETRY_KEY
    key_length: _GEOMETRY_KEY
    value_length: _GEOMETRY_KEY
    feed_forward_length: _GEOMETRY_KEY


@with_config(_STRICT)
class ModelSpec(TypedDict):
    """A catalog model, as the admin API takes it (CATALOG_MODEL checks it) and shows it,
    and as stored."""

    name: Annotated[str, AfterValidator(_name_shape)]
    aliases: Annotated[list[str], AfterValidator(_alias_shape), Field(default_factory=list)]
    description: Annotated[str, Field(default="")]
    source: Annotated[str, AfterValidator(_source_scheme)]
    # "" when the digest is unknown (and in rows stored before the catalog took one).
    sha256: Annotated[str, AfterValidator(_hex_digest), Field(default="")]
    routing_profile: Annotated[str, Field(default="chat")]
    context_length: Annotated[int, Field(default=4096, ge=1)]
    max_output: Annotated[int, Field(default=1024, ge=1)]
    scaling: Annotated[ScalingSpec, AfterValidator(_min_le_max),
                       Field(default_factory=lambda: defaults(ScalingSpec))]
    profiles: Annotated[list[Annotated[ProfileSpec, AfterValidator(_split_rules)]],
                        Field(min_length=1)]
    # The file's size and KV geometry: read from its GGUF header when the model is added
    # (the admin API fills them in), 0 where it could not be read (and in rows stored
    # before): what the scheduler checks a GPU's memory by.
    size_bytes: Annotated[int, Field(default=0, ge=0)]
    geometry: Annotated[Geometry, Field(default_factory=lambda: defaults(Geometry))]


def _unique_names(v: ModelSpec) -> ModelSpec:
    names = [p["name"] for p in v["profiles"]]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"profile names must be unique; repeated: {', '.join(dupes)}")
    if v["name"] in v["aliases"]:
        raise ValueError(f"alias {v['name']!r} repeats the model's own name")
    return v


# A catalog model as a client sends it: ModelSpec's fields, each checked, with what it
# leaves out filled in, and then the rules across fields.
CatalogModel = Annotated[ModelSpec, AfterValidator(_unique_names)]
CATALOG_MODEL: TypeAdapter[ModelSpec] = TypeAdapter(CatalogModel)

# A catalog model's optional fields as declared above (a row stored before one of them
# existed gets these when read).
SPEC_DEFAULTS = defaults(ModelSpec)


def names(model: ModelSpec) -> list[str]:
    """The name and every alias: what a client may ask for."""
    return [model["name"], *model["aliases"]]


def default_profiles(gpu_classes: list[str],
                     node_selector: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """The profiles a model gets when nobody wrote its own (the starter, `llmgw models add
    FILE`): one per GPU class, then CPU, each with node_selector when one is given."""
    pin = {"node_selector": dict(node_selector)} if node_selector else {}
    return [
        *({"name": f"gpu-{c}", "engine": "llamacpp", "gpu_class": c, "priority": 200,
           "min_memory_gb": 2, **pin, "args": ["--ctx-size", "32768"]} for c in gpu_classes),
        {"name": "cpu", "engine": "llamacpp", "priority": 100, "min_memory_gb": 2, **pin,
         "args": ["--ctx-size", "16384"]},
    ]
