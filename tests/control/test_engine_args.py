"""What an engine starts with beyond its profile's own arguments."""

from __future__ import annotations

from llmgw.control._upstream import MAX_CONNECTIONS_PER_REPLICA
from llmgw.control.engine_args import HTTP_THREADS, engine_args


def profile(*args: str) -> dict:
    return {"name": "cpu", "args": list(args)}


def test_an_engine_has_more_http_threads_than_the_gateway_holds_connections_to_it() -> None:
    args = engine_args({"name": "m", "routing_profile": "chat"}, profile("--ctx-size", "512"))
    assert args == ["--ctx-size", "512", "--threads-http", str(HTTP_THREADS)]
    assert HTTP_THREADS > MAX_CONNECTIONS_PER_REPLICA


def test_a_profiles_own_http_threads_are_kept() -> None:
    chat = {"name": "m", "routing_profile": "chat"}
    assert engine_args(chat, profile("--threads-http", "8")) == ["--threads-http", "8"]


def test_an_embedding_model_gets_embeddings_and_a_pooling_type_unless_its_profile_says() -> None:
    model = {"name": "e", "routing_profile": "embedding"}
    assert engine_args(model, profile())[:3] == ["--embeddings", "--pooling", "mean"]
    assert engine_args(model, profile("--pooling", "cls"))[:3] == [
        "--pooling", "cls", "--embeddings"]
