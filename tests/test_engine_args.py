"""The engine flag allow-list: what a catalog profile may pass to llama-server."""

from __future__ import annotations

import pytest

from llmgw.engine_args import TAKES_VALUE, EngineArgsError, check_engine_args


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
