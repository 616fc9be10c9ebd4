"""Viewer keys, on both backends: one live key a name, found by hash while live only."""

from __future__ import annotations

from collections.abc import Callable

from llmgw.store import Store

OpenStore = Callable[..., Store]


def _viewer(i: int, name: str) -> dict[str, str]:
    return {"id": f"v{i}", "name": name, "prefix": f"p{i}", "hash": f"h{i}"}


def test_a_viewer_key_is_found_by_its_hash_until_it_is_revoked(open_store: OpenStore) -> None:
    store = open_store()
    assert store.add_viewer(_viewer(1, "ops")) == ""
    assert store.add_viewer(_viewer(2, "ops")) == "name"
    assert store.add_viewer({**_viewer(1, "other"), "hash": "h9"}) == "id"
    assert store.viewer_by_hash("h1")["name"] == "ops"
    assert store.viewer_by_hash("h2") is None
    assert store.revoke_viewer("ops")["id"] == "v1"
    assert store.revoke_viewer("ops") is None, "revoked already"
    assert store.viewer_by_hash("h1") is None
    assert store.add_viewer(_viewer(2, "ops")) == "", "the name is free again"
    assert [v["id"] for v in store.viewers()] == ["v2"]
