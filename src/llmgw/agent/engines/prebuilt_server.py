"""A llama-server command line served by xllamacpp's prebuilt llama.cpp (stdlib + xllamacpp).

The agent copies this file, under a shebang of the venv that holds xllamacpp, into the
engine cache as `llama-server`: it takes the words the agent and llmgw.model.engine_args allow,
sets the matching `xllamacpp.CommonParams` fields, starts `xllamacpp.Server` (llama.cpp's
own HTTP server, in this process) and serves until SIGTERM. Any other flag exits 2 naming
it, as llama-server does. Nothing here imports llmgw: the cache's venv has only xllamacpp.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

DIST = "xllamacpp"
# The pinned release: `xllamacpp` versions are YEAR.MONTH.LLAMA_CPP_BUILD.
VERSION = "2026.10.11549"

Convert = Callable[[str], Any]


def _enum(name: str, prefix: str, **aliases: str) -> Convert:
    """A word to a member of xllamacpp's enum `name` (`q8_0` -> GGML_TYPE_Q8_0)."""

    def convert(word: str) -> Any:
        import xllamacpp

        member = prefix + aliases.get(word, word).upper()
        try:
            return getattr(xllamacpp, name)[member]
        except KeyError:
            raise ValueError(f"{word!r} is not one of {name}'s values") from None

    return convert


def _floats(word: str) -> list[float]:
    return [float(v) for v in word.replace(",", "/").split("/")]


def _on_off(word: str) -> bool:
    if word not in ("on", "off", "1", "0", "true", "false"):
        raise ValueError(f"{word!r} is not on or off")
    return word in ("on", "1", "true")


_FLASH = _enum("llama_flash_attn_type", "LLAMA_FLASH_ATTN_TYPE_",
               on="enabled", off="disabled", auto="auto")
_CACHE_TYPE = _enum("ggml_type", "GGML_TYPE_")

# Each spelling of a flag that takes a value -> (CommonParams field, converter).
_WITH_VALUE: dict[tuple[str, ...], tuple[str, Convert]] = {
    ("-m", "--model"): ("model.path", str),
    ("--host",): ("hostnames", lambda w: [w]),
    ("--port",): ("port", int),
    ("--api-key",): ("api_keys", lambda w: [w]),
    ("-a", "--alias"): ("model_alias", lambda w: {w}),
    ("-c", "--ctx-size"): ("n_ctx", int),
    ("-n", "--predict", "--n-predict"): ("n_predict", int),
    ("-b", "--batch-size"): ("n_batch", int),
    ("-ub", "--ubatch-size"): ("n_ubatch", int),
    ("--keep",): ("n_keep", int),
    ("-np", "--parallel"): ("n_parallel", int),
    ("-cram", "--cache-ram"): ("cache_ram_mib", int),
    ("--cache-reuse",): ("n_cache_reuse", int),
    ("-sps", "--slot-prompt-similarity"): ("slot_prompt_similarity", float),
    ("-to", "--timeout"): ("timeout_read timeout_write", int),
    ("-t", "--threads"): ("cpuparams.n_threads", int),
    ("-tb", "--threads-batch"): ("cpuparams_batch.n_threads", int),
    ("--threads-http",): ("n_threads_http", int),
    ("--prio",): ("cpuparams.priority", _enum("ggml_sched_priority", "GGML_SCHED_PRIO_",
                                               **{"-1": "low", "0": "normal", "1": "medium",
                                                  "2": "high", "3": "realtime"})),
    ("--prio-batch",): ("cpuparams_batch.priority",
                        _enum("ggml_sched_priority", "GGML_SCHED_PRIO_",
                              **{"0": "normal", "1": "medium", "2": "high", "3": "realtime"})),
    ("--poll",): ("cpuparams.poll", int),
    ("--poll-batch",): ("cpuparams_batch.poll", int),
    ("--numa",): ("numa", _enum("ggml_numa_strategy", "GGML_NUMA_STRATEGY_")),
    ("-lm", "--load-mode"): ("load_mode", _enum("llama_load_mode", "LLAMA_LOAD_MODE_")),
    ("-ngl", "--gpu-layers", "--n-gpu-layers"): (
        "n_gpu_layers", lambda w: {"auto": -1, "all": -2}.get(w) or int(w)),
    ("-sm", "--split-mode"): ("split_mode", _enum("llama_split_mode", "LLAMA_SPLIT_MODE_")),
    ("-ts", "--tensor-split"): ("tensor_split", _floats),
    ("-mg", "--main-gpu"): ("main_gpu", int),
    ("-fit", "--fit"): ("fit_params", _on_off),
    ("-fitc", "--fit-ctx"): ("fit_params_min_ctx", int),
    ("-ctk", "--cache-type-k"): ("cache_type_k", _CACHE_TYPE),
    ("-ctv", "--cache-type-v"): ("cache_type_v", _CACHE_TYPE),
    ("-fa", "--flash-attn"): ("flash_attn_type", _FLASH),
    ("--rope-scaling",): ("rope_scaling_type",
                          _enum("llama_rope_scaling_type", "LLAMA_ROPE_SCALING_TYPE_")),
    ("--rope-scale",): ("rope_freq_scale", lambda w: 1.0 / float(w)),
    ("--rope-freq-base",): ("rope_freq_base", float),
    ("--rope-freq-scale",): ("rope_freq_scale", float),
    ("--yarn-orig-ctx",): ("yarn_orig_ctx", int),
    ("--yarn-ext-factor",): ("yarn_ext_factor", float),
    ("--yarn-attn-factor",): ("yarn_attn_factor", float),
    ("--yarn-beta-slow",): ("yarn_beta_slow", float),
    ("--yarn-beta-fast",): ("yarn_beta_fast", float),
    ("--pooling",): ("pooling_type", _enum("llama_pooling_type", "LLAMA_POOLING_TYPE_")),
    ("--embd-normalize",): ("embd_normalize", int),
    ("--temp", "--temperature"): ("sampling.temp", float),
    ("--top-k",): ("sampling.top_k", int),
    ("--top-p",): ("sampling.top_p", float),
    ("--min-p",): ("sampling.min_p", float),
    ("--typical", "--typical-p"): ("sampling.typ_p", float),
    ("--repeat-last-n",): ("sampling.penalty_last_n", int),
    ("--repeat-penalty",): ("sampling.penalty_repeat", float),
    ("--presence-penalty",): ("sampling.penalty_present", float),
    ("--frequency-penalty",): ("sampling.penalty_freq", float),
    ("-s", "--seed"): ("sampling.seed", int),
    ("--mirostat",): ("sampling.mirostat", int),
    ("--mirostat-lr",): ("sampling.mirostat_eta", float),
    ("--mirostat-ent",): ("sampling.mirostat_tau", float),
    ("--dynatemp-range",): ("sampling.dynatemp_range", float),
    ("--dynatemp-exp",): ("sampling.dynatemp_exponent", float),
    ("--reasoning-format",): ("reasoning_format",
                              _enum("common_reasoning_format", "COMMON_REASONING_FORMAT_")),
    ("--reasoning-budget",): ("sampling.reasoning_budget_tokens", int),
    # Deprecated in llama.cpp itself, which takes and ignores it.
    ("-dt", "--defrag-thold"): ("", float),
}
_SWITCHES: dict[tuple[str, ...], list[tuple[str, Any]]] = {
    ("-cb", "--cont-batching"): [("cont_batching", True)],
    ("-nocb", "--no-cont-batching"): [("cont_batching", False)],
    ("-kvu", "--kv-unified"): [("kv_unified", True)],
    ("-no-kvu", "--no-kv-unified"): [("kv_unified", False)],
    ("--swa-full",): [("swa_full", True)],
    ("--context-shift",): [("ctx_shift", True)],
    ("--no-context-shift",): [("ctx_shift", False)],
    ("-kvo", "--kv-offload"): [("no_kv_offload", False)],
    ("-nkvo", "--no-kv-offload"): [("no_kv_offload", True)],
    ("--embedding", "--embeddings"): [("embedding", True)],
    ("--rerank", "--reranking"): [("embedding", True), ("pooling_type", "rank")],
    ("--cache-prompt",): [("cache_prompt", True)],
    ("--cache-idle-slots",): [("cache_idle_slots", True)],
    ("--no-cache-idle-slots",): [("cache_idle_slots", False)],
    ("--no-cache-prompt",): [("cache_prompt", False)],
    ("--jinja",): [("use_jinja", True)],
    ("--no-jinja",): [("use_jinja", False)],
    ("--warmup",): [("warmup", True)],
    ("--no-warmup",): [("warmup", False)],
    ("--metrics",): [("endpoint_metrics", True)],
    ("--slots",): [("endpoint_slots", True)],
    ("--no-slots",): [("endpoint_slots", False)],
}
# Flags llama-server has that this engine cannot honour, and why.
UNSUPPORTED = {
    "-ncmoe": "CPU expert placement is not offered by xllamacpp's parameters",
    "--n-cpu-moe": "CPU expert placement is not offered by xllamacpp's parameters",
    "-cmoe": "CPU expert placement is not offered by xllamacpp's parameters",
    "--cpu-moe": "CPU expert placement is not offered by xllamacpp's parameters",
}
DEVICE_FLAGS = ("-dev", "--device")
TAKES_VALUE: dict[str, tuple[str, Convert]] = {
    name: target for names, target in _WITH_VALUE.items() for name in names
}
SWITCHES: dict[str, list[tuple[str, Any]]] = {
    name: sets for names, sets in _SWITCHES.items() for name in names
}


class UsageError(ValueError):
    """A word on the command line this engine does not take."""


def parse(argv: list[str]) -> list[tuple[str, Any]]:
    """(field, value) pairs in order for a llama-server command line; UsageError otherwise."""
    sets: list[tuple[str, Any]] = []
    words = iter(argv)
    for word in words:
        if word in DEVICE_FLAGS:
            # The agent holds every CPU replica to the CPU with `--device none`: that is
            # what this engine does anyway; any other device it cannot honour.
            device = next(words, None)
            if device != "none":
                raise UsageError(f"{word} {device!r}: the prebuilt CPU engine runs on the CPU "
                                 "only (`--device none`); a GPU replica runs on llamacpp-cuda")
            continue
        if word in UNSUPPORTED:
            raise UsageError(f"{word}: {UNSUPPORTED[word]}")
        if word in SWITCHES:
            sets += SWITCHES[word]
            continue
        if word not in TAKES_VALUE:
            raise UsageError(f"unknown argument {word!r}: the prebuilt engine ({DIST}) takes "
                             "the flags llmgw.model.engine_args allows and the agent's own")
        value = next(words, None)
        if value is None:
            raise UsageError(f"{word} needs a value after it")
        fields, convert = TAKES_VALUE[word]
        try:
            converted = convert(value)
        except ValueError as e:
            raise UsageError(f"{word} {value!r}: {e}") from None
        sets += [(f, converted) for f in fields.split()]
    return sets


def _defaults(sets: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """llama-server's own server defaults where CommonParams' differ (arg.cpp's SERVER)."""
    named = {f for f, _ in sets}
    extra: list[tuple[str, Any]] = []
    if "n_parallel" not in named:
        # llama-server's -np auto: 4 slots sharing one unified KV cache.
        extra += [("n_parallel", 4)]
        if "kv_unified" not in named:
            extra += [("kv_unified", True)]
    return extra + sets


def apply(params: Any, sets: list[tuple[str, Any]]) -> None:
    """Set each field on params (dotted for the nested structs: `sampling.temp`)."""
    for field, value in sets:
        if not field:
            continue
        target = params
        *path, name = field.split(".")
        for part in path:
            target = getattr(target, part)
        if field == "pooling_type" and isinstance(value, str):
            value = _enum("llama_pooling_type", "LLAMA_POOLING_TYPE_")(value)
        setattr(target, name, value)


def version_text() -> str:
    """What `--version` prints: llmgw's engine check reads `version: ...`."""
    import xllamacpp

    return (f"version: {DIST}-{xllamacpp.__version__} (llama.cpp build "
            f"{xllamacpp.__version__.rsplit('.', 1)[-1]}, prebuilt wheel)\n"
            f"built with {xllamacpp.BUILD_INFO.get('compiler', 'unknown')} for "
            f"{xllamacpp.BUILD_INFO.get('build_target', 'unknown')}\n")


def devices_text() -> str:
    import xllamacpp

    lines = ["Available devices:"]
    for dev in xllamacpp.get_device_info():
        lines.append(f"  {dev.get('name', '?')}: {dev.get('description', '')}")
    return "\n".join(lines) + "\n"


def serve(argv: list[str]) -> int:
    """Start llama.cpp's server with argv's settings and serve until SIGTERM or SIGINT."""
    import xllamacpp

    params = xllamacpp.CommonParams()
    apply(params, _defaults(parse(argv)))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server = xllamacpp.Server(params)
    print(f"llmgw prebuilt engine: listening on {server.listening_address}", flush=True)
    stop.wait()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--version"]:
        sys.stderr.write(version_text())
        return 0
    if argv[:1] == ["--list-devices"]:
        sys.stdout.write(devices_text())
        return 0
    try:
        return serve(argv)
    except UsageError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
