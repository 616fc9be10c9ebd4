"""The arguments a replica's engine starts with: its profile's, plus what its model's
routing profile needs."""

from __future__ import annotations

from typing import Any

# Without a pooling type llama-server answers /v1/embeddings with 400 for a model whose
# file declares none (the tests' tiny GGUF among them).
DEFAULT_POOLING = "mean"


def engine_args(model: dict[str, Any], profile: dict[str, Any]) -> list[str]:
    args = list(profile.get("args") or [])
    if model.get("routing_profile") == "embedding":
        if "--embeddings" not in args and "--embedding" not in args:
            args.append("--embeddings")
        if "--pooling" not in args:
            args += ["--pooling", DEFAULT_POOLING]
    return args
