"""The catalog's shape: what a model must be to be served, checked on the way in (the admin
API) and filled in on the way out (the store). The one definition of these rules; the
TypedDicts of contract.records (ModelSpec, ProfileSpec, ScalingSpec, Geometry) are their
dumped form, which readers hold, and a test holds the two to the same fields."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from llmgw.contract.states import CPU_ENGINE
from llmgw.engine_args import check_engine_args

# A profile names the engine family; a GPU profile runs on its CUDA build (llamacpp-cuda).
ENGINES = (CPU_ENGINE,)
# No file://: the agent runs as root and would read any file the catalog named.
SOURCE_SCHEMES = ("hf:", "https://", "http://")
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Scaling(_Strict):
    min: int = Field(1, ge=0, le=64)
    max: int = Field(1, ge=1, le=64)

    @model_validator(mode="after")
    def _min_le_max(self) -> Scaling:
        if self.min > self.max:
            raise ValueError(f"scaling.min ({self.min}) is above scaling.max ({self.max})")
        return self


class Profile(_Strict):
    """One way to serve the model: on which engine, what hardware, with which arguments."""

    name: str = Field(min_length=1, max_length=64)
    engine: str
    gpu_class: str = ""
    priority: int = Field(100, ge=0, le=10_000)
    min_memory_gb: float = Field(0, ge=0)
    node_selector: dict[str, str] = Field(default_factory=dict)
    args: list[str] = Field(default_factory=list)

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, v: str) -> str:
        if v not in ENGINES:
            raise ValueError(f"engine {v!r} is unknown; llmgw serves {', '.join(ENGINES)}")
        return v

    @field_validator("args")
    @classmethod
    def _allowed_args(cls, v: list[str]) -> list[str]:
        check_engine_args(v)
        return v


class Geometry(_Strict):
    """A model's KV-cache shape from its GGUF header (contract.records.Geometry); 0 where
    the file does not say."""

    block_count: int = Field(0, ge=0)
    context_length: int = Field(0, ge=0)
    head_count: int = Field(0, ge=0)
    head_count_kv: int = Field(0, ge=0)
    embedding_length: int = Field(0, ge=0)
    key_length: int = Field(0, ge=0)
    value_length: int = Field(0, ge=0)
    feed_forward_length: int = Field(0, ge=0)


class Model(_Strict):
    """A catalog model, as the admin API takes it (`llmgw models add FILE`)."""

    name: str
    aliases: list[str] = Field(default_factory=list)
    description: str = ""
    source: str
    sha256: str = ""
    routing_profile: str = "chat"
    context_length: int = Field(4096, ge=1)
    max_output: int = Field(1024, ge=1)
    scaling: Scaling = Field(default_factory=Scaling)
    profiles: list[Profile] = Field(min_length=1)
    # The file's size and KV geometry: read from its GGUF header when it is added (the
    # admin API fills them in), 0 where it could not be read.
    size_bytes: int = Field(0, ge=0)
    geometry: Geometry = Field(default_factory=Geometry)

    @field_validator("name")
    @classmethod
    def _name_shape(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(
                f"name {v!r} must be lower-case letters, digits, '.', '_' or '-', "
                "starting with a letter or digit, at most 128 characters"
            )
        return v

    @field_validator("aliases")
    @classmethod
    def _alias_shape(cls, v: list[str]) -> list[str]:
        for alias in v:
            cls._name_shape(alias)
        return v

    @field_validator("source")
    @classmethod
    def _source_scheme(cls, v: str) -> str:
        if v.startswith("file:"):
            raise ValueError(
                f"source {v!r} is a file on the control plane's machine, which nodes cannot "
                "read; put it in the mirror with `llmgw mirror import FILE --model M --version "
                "V` and use the URL that prints"
            )
        if not v.startswith(SOURCE_SCHEMES):
            raise ValueError(f"source {v!r} must start with one of {', '.join(SOURCE_SCHEMES)}")
        return v

    @field_validator("sha256")
    @classmethod
    def _hex_digest(cls, v: str) -> str:
        if v and not re.fullmatch(r"[0-9a-f]{64}", v):
            raise ValueError("sha256 must be 64 lower-case hex digits, or empty when unknown")
        return v

    @model_validator(mode="after")
    def _unique_profiles(self) -> Model:
        names = [p.name for p in self.profiles]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"profile names must be unique; repeated: {', '.join(dupes)}")
        if self.name in self.aliases:
            raise ValueError(f"alias {self.name!r} repeats the model's own name")
        return self

    def names(self) -> list[str]:
        """The name and every alias: what a client may ask for."""
        return [self.name, *self.aliases]


def _defaults() -> dict[str, object]:
    example = Model(name="x", source="http://x", profiles=[Profile(name="p", engine="llamacpp")])
    return {name: value for name, value in example.model_dump().items()
            if not Model.model_fields[name].is_required()}


# A catalog model's optional fields as Model fills them in (a row stored before one of them
# existed gets these when read).
SPEC_DEFAULTS = _defaults()
