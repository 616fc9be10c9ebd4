"""A replica's llama-server arguments: the flags a catalog profile may pass (those that tune
how the model runs), and the command line a replica's engine starts with.

The agent runs as root and appends a profile's args to the engine's command line, so a
flag that names a path, a listen address or a key, or that changes what the engine loads
or where it writes (--api-key, --host, --port, --log-file, -m/--model, --lora, --path,
--slot-save-path, ...), would hand whoever edits the catalog root's powers. Only the flags
below pass; the catalog refuses the rest with 422 and the agent checks again before it
starts an engine. Names follow llama.cpp's common/arg.cpp (llama-cpp-python 0.3.36); like
llama.cpp, a flag and its value are separate words (no --flag=value).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmgw.contract.records import ModelSpec, ProfileSpec

from llmgw.errors import Error

# cpp-httplib gives each open connection one of the engine's HTTP threads for as long as
# requests keep coming on it; a connection beyond the threads waits, unserved, until one
# frees. With 32 busy keep-alive connections on a default engine (6 threads: slots + 2) a
# new connection waited 5-7 s, and so did the agent's /health probe, on its own fresh
# connection (measured against llama-server). So the gateway opens at most this many
# connections to one replica, in use and idle together (llmgw.gateway._upstream), and the
# agent starts engines with more HTTP threads than this (HTTP_THREADS below): some are
# always free for the probe. A request beyond them waits in the gateway for a connection,
# not in the engine. Here, not in the gateway, because the agent needs it too.
MAX_CONNECTIONS_PER_REPLICA = 64

# Each entry: the spellings of one flag, and whether it takes a value.
_WITH_VALUE = [
    # context, batching, slots
    ("-c", "--ctx-size"), ("-n", "--predict", "--n-predict"), ("-b", "--batch-size"),
    ("-ub", "--ubatch-size"), ("--keep",), ("-np", "--parallel"), ("-cram", "--cache-ram"),
    ("--cache-reuse",), ("-dt", "--defrag-thold"), ("-to", "--timeout"),
    ("-sps", "--slot-prompt-similarity"),
    # threads and scheduling
    ("-t", "--threads"), ("-tb", "--threads-batch"), ("--threads-http",), ("--prio",),
    ("--prio-batch",), ("--poll",), ("--poll-batch",), ("--numa",), ("-lm", "--load-mode"),
    # GPUs and memory
    ("-ngl", "--gpu-layers", "--n-gpu-layers"), ("-sm", "--split-mode"),
    ("-ts", "--tensor-split"), ("-mg", "--main-gpu"), ("-dev", "--device"),
    ("-ncmoe", "--n-cpu-moe"), ("-fit", "--fit"), ("-fitc", "--fit-ctx"),
    ("-ctk", "--cache-type-k"), ("-ctv", "--cache-type-v"), ("-fa", "--flash-attn"),
    # rope scaling
    ("--rope-scaling",), ("--rope-scale",), ("--rope-freq-base",), ("--rope-freq-scale",),
    ("--yarn-orig-ctx",), ("--yarn-ext-factor",), ("--yarn-attn-factor",),
    ("--yarn-beta-slow",), ("--yarn-beta-fast",),
    # embeddings
    ("--pooling",), ("--embd-normalize",),
    # sampling defaults
    ("--temp", "--temperature"), ("--top-k",), ("--top-p",), ("--min-p",),
    ("--typical", "--typical-p"), ("--repeat-last-n",), ("--repeat-penalty",),
    ("--presence-penalty",), ("--frequency-penalty",), ("-s", "--seed"), ("--mirostat",),
    ("--mirostat-lr",), ("--mirostat-ent",), ("--dynatemp-range",), ("--dynatemp-exp",),
    # chat
    ("--reasoning-format",), ("--reasoning-budget",),
]
_SWITCHES = [
    ("-cb", "--cont-batching"), ("-nocb", "--no-cont-batching"),
    ("-kvu", "--kv-unified"), ("-no-kvu", "--no-kv-unified"), ("--swa-full",),
    ("--context-shift",), ("--no-context-shift",), ("-kvo", "--kv-offload"),
    ("-nkvo", "--no-kv-offload"), ("-cmoe", "--cpu-moe"), ("--embedding", "--embeddings"),
    ("--rerank", "--reranking"), ("--cache-prompt",), ("--no-cache-prompt",), ("--jinja",),
    ("--cache-idle-slots",), ("--no-cache-idle-slots",),
    ("--no-jinja",), ("--warmup",), ("--no-warmup",), ("--metrics",),
]
TAKES_VALUE: dict[str, bool] = {
    **{name: True for names in _WITH_VALUE for name in names},
    **{name: False for names in _SWITCHES for name in names},
}
# A value is a number, a word or a list of them: never a path, a URL or another flag.
_VALUE = re.compile(r"^-?[A-Za-z0-9_.,:+][A-Za-z0-9_.,:+-]{0,63}$")


# rpc-server's own flags a profile may pass to a split replica's workers: its CPU threads.
# Its listen address and port, devices and file cache are the agent's (rpc-server listens
# on 127.0.0.1 only, behind llmgw.agent.rpc_relay); --rpc, on the main engine, is not in
# TAKES_VALUE, so a catalog cannot point an engine at an rpc-server either.
RPC_SERVER_FLAGS = {"-t": "--threads", "--threads": "--threads"}


class EngineArgsError(Error, ValueError):
    """A profile's args hold a flag or value the engine may not be given."""


def check_engine_args(args: list[str]) -> None:
    """EngineArgsError naming the first word that is not an allowed flag or its value."""
    words = iter(args)
    for word in words:
        if word not in TAKES_VALUE:
            raise EngineArgsError(_refusal(word))
        if not TAKES_VALUE[word]:
            continue
        value = next(words, None)
        if value is None:
            raise EngineArgsError(f"engine flag {word} needs a value after it")
        if value.startswith("--") or not _VALUE.match(value):
            raise EngineArgsError(
                f"engine flag {word} has the value {value!r}; values are numbers or words "
                "(letters, digits, . , : + - _), never paths, URLs or other flags"
            )


def _refusal(word: str) -> str:
    flag = word.split("=", 1)[0]
    if not flag.startswith("-"):
        return (f"engine args hold {word!r}, which is no flag's value; write each flag "
                "followed by its value")
    if "=" in word and flag in TAKES_VALUE:
        return f"engine flag {word!r}: write {flag} and its value as two words"
    return (f"engine flag {flag} is not allowed: a profile may only tune how the model runs "
            "(context, threads, batches, slots, GPU layers, cache types, rope scaling, "
            "embeddings, sampling defaults); paths, listen addresses, keys, logs and what "
            "the engine loads are llmgw's to set. See llmgw.model.engine_args for the list")


# --- what a replica's engine starts with ---

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


# The gateway owns a chat replica's slots (gateway/_slottable.py): it pins a conversation
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


def rpc_server_args(args: list[str]) -> list[str]:
    """The flags of a profile's (checked) args that a split replica's rpc-server takes too,
    in rpc-server's spelling; the rest are the main engine's."""
    words = iter(args)
    picked: list[str] = []
    for word in words:
        value = next(words, "") if TAKES_VALUE.get(word) else None
        if word in RPC_SERVER_FLAGS and value:
            picked = [RPC_SERVER_FLAGS[word], value]
    return picked
