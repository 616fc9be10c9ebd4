"""The one explainer of a refused shape, for every boundary (server.yaml and agent.yaml,
heartbeats, store rows, admin API bodies): one clause per problem, naming where (dotted
key), what was found and what is allowed."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import BaseModel, ValidationError


def problems(e: ValidationError | Iterable[Mapping[str, Any]],
             model: type[BaseModel] | None = None, *, within: str = "") -> str:
    """`tokens.0 is 12345: Input should be a valid string; ...` for each error (a pydantic
    ValidationError, or errors as FastAPI gives them); an unknown key lists the keys known
    there when model (the shape validated) says them. within: a first location part to
    leave out (FastAPI's "body")."""
    errors = e.errors() if isinstance(e, ValidationError) else e
    return "; ".join(problem(error, model, within=within) for error in errors)


def problem(error: Mapping[str, Any], model: type[BaseModel] | None = None, *,
            within: str = "") -> str:
    loc = list(error["loc"])
    if within and loc[:1] == [within]:
        loc = loc[1:]
    error = {**error, "loc": tuple(loc)}
    where = ".".join(str(part) for part in error["loc"]) or "the whole value"
    # A dataclass (`Limits`) says "unexpected_keyword_argument" where a model says
    # "extra_forbidden": both are a key the shape does not know.
    unknown = error["type"] in ("extra_forbidden", "unexpected_keyword_argument")
    if unknown and model is not None:
        section: Any = model
        for part in error["loc"][:-1]:
            fields = getattr(section, "model_fields", {})
            section = fields[str(part)].annotation if str(part) in fields else None
        known = ", ".join(_keys(section)) or "none"
        return f"{where} is not a known key (known here: {known})"
    if unknown:
        return f"{where} is not a known key"
    if error["type"] == "missing":
        return f"{where} is missing"
    message = str(error["msg"]).removeprefix("Value error, ")
    return f"{where} is {error.get('input')!r}: {message}"


def _keys(section: Any) -> list[str]:
    """The keys a validated shape knows: a model's fields, or a dataclass's (`Limits`)."""
    if dataclasses.is_dataclass(section):
        return [f.name for f in dataclasses.fields(section)]
    return list(getattr(section, "model_fields", {}))
