"""The one explainer of a refused shape, for every boundary (server.yaml and agent.yaml,
heartbeats, store rows, admin API bodies): one clause per problem, naming where (dotted
key), what was found and what is allowed."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails


def problems(e: ValidationError, model: type[BaseModel] | None = None) -> str:
    """`tokens.0 is 12345: Input should be a valid string; ...` for each of e's errors; an
    unknown key lists the keys known there when model (the shape validated) says them."""
    return "; ".join(problem(error, model) for error in e.errors())


def problem(error: ErrorDetails, model: type[BaseModel] | None = None) -> str:
    where = ".".join(str(part) for part in error["loc"]) or "the whole value"
    if error["type"] == "extra_forbidden" and model is not None:
        section: Any = model
        for part in error["loc"][:-1]:
            fields = getattr(section, "model_fields", {})
            section = fields[str(part)].annotation if str(part) in fields else None
        known = ", ".join(getattr(section, "model_fields", {})) or "none"
        return f"{where} is not a known key (known here: {known})"
    if error["type"] == "extra_forbidden":
        return f"{where} is not a known key"
    if error["type"] == "missing":
        return f"{where} is missing"
    message = str(error["msg"]).removeprefix("Value error, ")
    return f"{where} is {error['input']!r}: {message}"
