"""The fleet page's sessions in the store, on both backends: kept by hash, found with their
viewer key's state, ended once, and bounded per credential before in all."""

from __future__ import annotations

from collections.abc import Callable

import sqlalchemy as sa

from llmgw.store import Store
from llmgw.store._schema import sessions

OpenStore = Callable[..., Store]


def _session(n: int, credential: str, role: str = "viewer", expires: float = 1e12) -> dict:
    return {"hash": f"s{n:05d}", "role": role, "name": credential, "credential": credential,
            "expires": expires}


def _left(store: Store) -> dict[str, int]:
    rows = store.db.read(sa.select(sessions.c.credential, sa.func.count())
                         .group_by(sessions.c.credential))
    return {r["credential"]: r["count"] for r in rows}


def test_a_session_is_found_by_its_hash_until_it_is_ended(open_store: OpenStore) -> None:
    store = open_store()
    assert store.add_session(_session(1, "a", role="admin"), per_credential=9, total=9) == []
    found = store.session("s00001")
    assert found is not None and (found["role"], found["credential"]) == ("admin", "a")
    assert found["viewer_live"] and found["viewer_expires"] is None
    assert store.session("s00002") is None, "the control: a hash never stored is not found"
    assert store.end_session("s00001") and not store.end_session("s00001")
    assert store.session("s00001") is None


def test_a_viewer_session_carries_its_keys_revocation_and_expiry(open_store: OpenStore) -> None:
    store = open_store()
    store.add_viewer({"id": "v1", "name": "ops", "prefix": "p1", "hash": "vh", "expires": 5e9})
    store.add_session(_session(1, "vh"), per_credential=9, total=9)
    store.add_session(_session(2, "gone"), per_credential=9, total=9)
    live = store.session("s00001")
    assert live is not None and live["viewer_live"] and live["viewer_expires"] == 5e9
    unknown = store.session("s00002")
    assert unknown is not None and not unknown["viewer_live"], "no viewer key has that hash"
    store.revoke_viewer("ops")
    revoked = store.session("s00001")
    assert revoked is not None and not revoked["viewer_live"]


def test_past_its_bound_a_credential_ends_its_own_oldest_sessions(
        open_store: OpenStore) -> None:
    """A viewer key signing in again and again ends its own oldest sessions and never the
    admin's. (The control: the admin's own sessions past the bound end too.)"""
    store = open_store()
    t = [100.0]
    store.clock = lambda: t[0]
    store.add_session(_session(0, "admin", role="admin"), per_credential=3, total=9)
    ended = []
    for n in range(1, 8):
        t[0] += 1
        ended += store.add_session(_session(n, "viewer"), per_credential=3, total=9)
    assert ended == ["s00001", "s00002", "s00003", "s00004"], "oldest first, its own"
    assert _left(store) == {"admin": 1, "viewer": 3}
    assert store.session("s00000") is not None
    for n in range(8, 12):
        t[0] += 1
        store.add_session(_session(n, "admin", role="admin"), per_credential=3, total=9)
    assert store.session("s00000") is None and _left(store)["admin"] == 3


def test_past_the_bound_in_all_the_credential_holding_most_gives_way(
        open_store: OpenStore) -> None:
    store = open_store()
    t = [100.0]
    store.clock = lambda: t[0]
    made = [("admin", "admin"), ("v1", "viewer"), ("v1", "viewer"), ("v2", "viewer"),
            ("v1", "viewer"), ("v2", "viewer")]
    ended = []
    for n, (credential, role) in enumerate(made):
        t[0] += 1
        ended += store.add_session(_session(n, credential, role), per_credential=3, total=5)
    assert ended == ["s00001"], "v1 held the most: its oldest went, never the admin's"
    assert _left(store) == {"admin": 1, "v1": 2, "v2": 2}
    t[0] += 1
    ended = store.add_session(_session(9, "admin", "admin"), per_credential=3, total=5)
    assert ended == ["s00000"], "all three hold two: the one signing in gives way"


def test_expired_sessions_go_at_the_next_sign_in(open_store: OpenStore) -> None:
    store = open_store()
    t = [100.0]
    store.clock = lambda: t[0]
    store.add_session(_session(1, "a", expires=150.0), per_credential=9, total=9)
    t[0] = 149.0
    store.add_session(_session(2, "a", expires=1e9), per_credential=9, total=9)
    assert store.session("s00001") is not None, "the control: not yet expired, kept"
    t[0] = 150.0
    store.add_session(_session(3, "b", expires=1e9), per_credential=9, total=9)
    assert store.session("s00001") is None and _left(store) == {"a": 1, "b": 1}


def test_a_new_admin_token_ends_every_session_of_another(open_store: OpenStore) -> None:
    store = open_store()
    for n, (credential, role) in enumerate([("old", "admin"), ("new", "admin"),
                                            ("old", "viewer")]):
        store.add_session(_session(n, credential, role), per_credential=9, total=9)
    assert store.end_admin_sessions_but("new") == 1
    assert [store.session(f"s0000{n}") is not None for n in range(3)] == [False, True, True]


def test_a_copy_of_the_store_leaves_the_sessions_behind(open_store: OpenStore,
                                                        tmp_path) -> None:
    """Backup, restore and `store migrate` copy every table but the sessions: a restored
    backup never revives a session signed out after it was taken. (The control: the viewer
    key beside it is copied, and the source still holds its session.)"""
    from llmgw.store import copy

    store = open_store()
    store.add_viewer({"id": "v1", "name": "ops", "prefix": "p1", "hash": "vh"})
    store.add_session(_session(1, "vh"), per_credential=9, total=9)
    taken = copy.read(store)
    assert "sessions" not in taken.rows and taken.counts()["viewers"] == 1
    restored = Store(tmp_path / "restored.db")
    copy.write_verified(restored, taken)
    assert restored.session("s00001") is None and restored.viewer_by_hash("vh") is not None
    assert store.session("s00001") is not None
    restored.close()
