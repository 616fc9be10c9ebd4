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


# The gateway owns a chat replica's slots (control/_slottable.py): it pins a conversation
# to the slot that holds it (id_slot) and otherwise lets the engine place it. With a
# similarity of 0 the engine then takes its least recently used idle slot and always
# moves states through its prompt cache in RAM (the slot's out, the request's best match
# in), where the default 0.1 took any slot sharing a system prompt and recomputed the
# conversation from there; and with idle slots not saved and cleared on each new task
# (llama-server clears them when its slots share one KV buffer, the default with 4 slots),
# a slot still holds its conversation when it comes back. bench/README.md has the
# measurements.
SLOT_ARGS = {("-sps", "--slot-prompt-similarity"): ["--slot-prompt-similarity", "0"],
             ("--cache-idle-slots", "--no-cache-idle-slots"): ["--no-cache-idle-slots"]}


def engine_args(model: ModelSpec, profile: ProfileSpec) -> list[str]:
    """A profile that sets --threads-http itself keeps its value (and the probe may then
    wait behind the gateway's connections again); one that sets a flag of SLOT_ARGS
    keeps its own."""
    args = list(profile["args"])
    if model["routing_profile"] == "embedding":
        if "--embeddings" not in args and "--embedding" not in args:
            args.append("--embeddings")
        if "--pooling" not in args:
            args += ["--pooling", DEFAULT_POOLING]
    else:
        for spellings, added in SLOT_ARGS.items():
            if not any(a in args for a in spellings):
                args += added
    if "--threads-http" not in args:
        args += ["--threads-http", str(HTTP_THREADS)]
    return args
