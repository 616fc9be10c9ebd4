"""The catalog, on both backends: names unique, specs read whole with the defaults."""

from __future__ import annotations

from collections.abc import Callable

from llmgw.store import Store

OpenStore = Callable[..., Store]
SPEC = {"name": "m", "source": "http://mirror/m.gguf", "sha256": "",
        "profiles": [{"name": "cpu", "engine": "llamacpp", "gpu_class": "", "args": []}]}


def test_a_name_is_one_models_and_a_deleted_one_is_free(open_store: OpenStore) -> None:
    store = open_store(clock=lambda: 1234.5)
    assert store.add_model(SPEC)
    assert not store.add_model({**SPEC, "source": "http://elsewhere"}), "the name is taken"
    assert store.model("m")["source"] == "http://mirror/m.gguf"
    assert store.created() == {"m": 1234}
    assert store.delete_model("m") and not store.delete_model("m")
    assert store.models() == [] and store.model("m") is None
    assert store.add_model(SPEC)


def test_a_stored_model_is_read_with_the_catalogs_defaults(open_store: OpenStore) -> None:
    store = open_store()
    store.add_model(SPEC)
    (model,) = store.models()
    assert (model["routing_profile"], model["size_bytes"]) == ("chat", 0)
    model["aliases"].append("x")
    assert store.model("m")["aliases"] == [], "each read gets its own defaults"
