"""Gateway keys, on both backends: one live key a name, revoked keys kept with their usage,
usage added in batches."""

from __future__ import annotations

from collections.abc import Callable

from llmgw.store import Store

OpenStore = Callable[..., Store]


def _key(i: int, name: str) -> dict[str, object]:
    return {"id": f"k{i}", "name": name, "prefix": f"p{i}", "hash": f"h{i}", "rpm": 0,
            "tpm": 0, "expires": None, "models": ["m"]}


def test_a_name_is_one_live_keys_and_a_revoked_key_frees_it(open_store: OpenStore) -> None:
    store = open_store()
    assert store.add_key(_key(1, "ci")) == ""
    assert store.add_key(_key(2, "ci")) == "name"
    assert store.add_key({**_key(1, "other"), "hash": "h9"}) == "id"
    assert store.revoke_key("p1")["name"] == "ci"
    assert store.revoke_key("p1") is None, "revoked already"
    assert store.add_key(_key(2, "ci")) == "", "the name is free again"
    assert [k["id"] for k in store.keys()] == ["k2"]
    assert [k["id"] for k in store.keys(revoked=True)] == ["k1", "k2"]
    assert store.keys()[0]["models"] == ["m"]


def test_usage_adds_up_and_last_used_only_moves_forward(open_store: OpenStore) -> None:
    store = open_store()
    store.add_key(_key(1, "a"))
    store.add_key(_key(2, "b"))
    store.add_key_usage({"k1": (2, 10, 20, 500.0), "k2": (1, 1, 1, 300.0)})
    store.add_key_usage({"k1": (1, 5, 5, 400.0)})
    k1, k2 = store.keys()
    assert (k1["requests"], k1["prompt_tokens"], k1["completion_tokens"], k1["last_used"]) == (
        3, 15, 25, 500.0)
    assert (k2["requests"], k2["last_used"]) == (1, 300.0)
