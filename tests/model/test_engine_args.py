"""A replica's engine arguments: the flag allow-list (what a catalog profile may pass to
llama-server), and what an engine starts with beyond its profile's own arguments."""

from __future__ import annotations

import pytest

from llmgw.agent.engines import prebuilt_server
from llmgw.gateway._upstream import MAX_CONNECTIONS_PER_REPLICA
from llmgw.model.engine_args import (
    HTTP_THREADS,
    SLOT_ARGS,
    TAKES_VALUE,
    EngineArgsError,
    check_engine_args,
    engine_args,
)


@pytest.mark.parametrize("args", [
    [],
    ["--ctx-size", "16384"],
    ["-c", "512", "-t", "2", "-tb", "2", "-b", "512", "-ub", "128", "-np", "4"],
    ["-ngl", "-1", "--split-mode", "layer", "--tensor-split", "3,1", "--main-gpu", "0"],
    ["--flash-attn", "on", "-ctk", "q8_0", "-ctv", "q4_0", "--no-kv-offload"],
    ["--rope-scaling", "yarn", "--rope-scale", "4", "--yarn-orig-ctx", "32768"],
    ["--embeddings", "--pooling", "mean"],
    ["--temp", "0.7", "--top-p", "0.9", "--seed", "42", "--cont-batching", "--jinja"],
])
def test_flags_that_tune_the_model_pass(args: list[str]) -> None:
    check_engine_args(args)


@pytest.mark.parametrize(("args", "named"), [
    (["--api-key", "k"], "--api-key"),
    (["--api-key-file", "/etc/shadow"], "--api-key-file"),
    (["--host", "0.0.0.0"], "--host"),
    (["--port", "80"], "--port"),
    (["--log-file", "/tmp/x"], "--log-file"),
    (["-m", "/root/x.gguf"], "-m"),
    (["--model", "/root/x.gguf"], "--model"),
    (["-hf", "org/repo"], "-hf"),
    (["--lora", "/x"], "--lora"),
    (["--mmproj", "/x"], "--mmproj"),
    (["--slot-save-path", "/x"], "--slot-save-path"),
    (["--path", "/"], "--path"),
    (["--chat-template-file", "/etc/passwd"], "--chat-template-file"),
    (["--ssl-key-file", "/x"], "--ssl-key-file"),
    (["--ctx-size", "512", "--log-file", "/tmp/x"], "--log-file"),
])
def test_paths_listen_addresses_keys_and_logs_are_refused_by_name(args, named) -> None:
    with pytest.raises(EngineArgsError, match=f"engine flag {named} is not allowed"):
        check_engine_args(args)


@pytest.mark.parametrize(("args", "why"), [
    (["--ctx-size"], "needs a value"),
    (["--ctx-size", "--api-key"], "never paths"),
    (["--ctx-size", "/tmp/x"], "never paths"),
    (["--pooling", "http://x/y"], "never paths"),
    (["--ctx-size=512"], "as two words"),
    (["--api-key=k"], "--api-key is not allowed"),
    (["512"], "no flag's value"),
    (["--embeddings", "/tmp/x"], "no flag's value"),
])
def test_values_are_numbers_or_words_never_paths(args, why) -> None:
    with pytest.raises(EngineArgsError, match=why):
        check_engine_args(args)


def test_no_allowed_flag_names_a_path_a_listener_or_a_key() -> None:
    forbidden = ("file", "path", "dir", "host", "port", "key", "model", "url", "log", "lora")
    suspicious = [f for f in TAKES_VALUE if any(w in f for w in forbidden)]
    assert suspicious == [], suspicious


# --- what an engine starts with ---

CHAT = {"name": "m", "routing_profile": "chat"}
SLOTS = [w for added in SLOT_ARGS.values() for w in added]


def profile(*args: str) -> dict:
    return {"name": "cpu", "args": list(args)}


def test_an_engine_has_more_http_threads_than_the_gateway_holds_connections_to_it() -> None:
    args = engine_args(CHAT, profile("--ctx-size", "512"))
    assert args == ["--ctx-size", "512", *SLOTS, "--threads-http", str(HTTP_THREADS)]
    assert HTTP_THREADS > MAX_CONNECTIONS_PER_REPLICA


def test_a_profiles_own_http_threads_are_kept() -> None:
    assert engine_args(CHAT, profile("--threads-http", "8")) == [
        "--threads-http", "8", *SLOTS]


def test_a_chat_engine_lets_the_gateway_own_its_slots() -> None:
    """Similarity 0 (the engine places what the gateway does not pin by LRU, through its
    prompt cache) and idle slots kept: SLOT_ARGS, each of which a profile may set itself."""
    assert SLOTS == ["--slot-prompt-similarity", "0", "--no-cache-idle-slots"]
    assert engine_args(CHAT, profile())[:3] == SLOTS


@pytest.mark.parametrize("own", [["-sps", "0.5"], ["--slot-prompt-similarity", "0.2"],
                                 ["--cache-idle-slots"], ["--no-cache-idle-slots"]])
def test_a_profiles_own_slot_flags_win(own: list[str]) -> None:
    args = engine_args(CHAT, profile(*own))
    assert args[:len(own)] == own
    given = next(s for s in SLOT_ARGS if own[0] in s)
    assert sum(args.count(s) for s in given) == 1, args


def test_every_flag_the_control_plane_adds_passes_the_agents_check_and_both_engines() -> None:
    """The agent checks a replica's args again (llmgw.model.engine_args), and the prebuilt engine
    (xllamacpp) takes a fixed list of flags: what engine_args adds is in both. The negative
    control: a flag outside them is refused by both."""
    for model in (CHAT, {"name": "e", "routing_profile": "embedding"}):
        args = engine_args(model, profile())
        check_engine_args(args)
        flags = [a for a in args if a.startswith("-")]
        assert all(f in prebuilt_server.TAKES_VALUE or f in prebuilt_server.SWITCHES
                   for f in flags), flags
    with pytest.raises(ValueError, match="--slot-save-path"):
        check_engine_args(["--slot-save-path", "x"])
    with pytest.raises(prebuilt_server.UsageError, match="--slot-save-path"):
        prebuilt_server.parse(["--slot-save-path", "x"])
    assert prebuilt_server.parse(SLOTS) == [("slot_prompt_similarity", 0.0),
                                            ("cache_idle_slots", False)]


def test_an_embedding_model_gets_embeddings_and_a_pooling_type_unless_its_profile_says() -> None:
    model = {"name": "e", "routing_profile": "embedding"}
    assert engine_args(model, profile())[:3] == ["--embeddings", "--pooling", "mean"]
    assert not set(SLOTS) & set(engine_args(model, profile())), "no slots to own"
    assert engine_args(model, profile("--pooling", "cls"))[:3] == [
        "--pooling", "cls", "--embeddings"]


def test_the_engine_args_are_one_module() -> None:
    """What a profile may pass and what an engine starts with live side by side, so the
    flags the control plane adds are checked by the same list (no second engine_args)."""
    from pathlib import Path

    src = Path(__file__).resolve().parents[2] / "src"
    assert [str(p.relative_to(src)) for p in src.rglob("model/engine_args.py")] == \
        ["llmgw/model/engine_args.py"]
