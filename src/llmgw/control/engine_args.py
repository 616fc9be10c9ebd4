"""The arguments a replica's engine starts with: its profile's, plus what its model's
routing profile and the gateway in front of it need."""

from __future__ import annotations

from llmgw.contract.records import ModelSpec, ProfileSpec
from llmgw.control._upstream import MAX_CONNECTIONS_PER_REPLICA

# Without a pooling type llama-server answers /v1/embeddings with 400 for a model whose
# file declares none (the tests' tiny GGUF among them).
DEFAULT_POOLING = "mean"

# llama-server (cpp-httplib) serves each open connection on one of its HTTP threads, and
# by default has only slots + 2 of them. The gateway holds at most
# MAX_CONNECTIONS_PER_REPLICA connections to a replica; with more threads than that, some
# are always free for the agent's /health probe and the metrics scrape, which would
# otherwise wait seconds behind the gateway's connections. An idle thread costs
# a stack of address space, no CPU.
HTTP_THREADS = MAX_CONNECTIONS_PER_REPLICA + 16


def engine_args(model: ModelSpec, profile: ProfileSpec) -> list[str]:
    """A profile that sets --threads-http itself keeps its value (and the probe may then
    wait behind the gateway's connections again)."""
    args = list(profile["args"])
    if model["routing_profile"] == "embedding":
        if "--embeddings" not in args and "--embedding" not in args:
            args.append("--embeddings")
        if "--pooling" not in args:
            args += ["--pooling", DEFAULT_POOLING]
    if "--threads-http" not in args:
        args += ["--threads-http", str(HTTP_THREADS)]
    return args
