"""The fleet page's sessions end when they should, on every control plane: they live in the
store (by the sha256 of the cookie, never the cookie), so a session made on one control
plane is honoured by another of the fleet and signing out on either ends it on both; a
session refused for a new admin token is forgotten there and then, one refused for its
viewer key is kept, refused, so that every control plane says why; one credential signing in
over and over ends only its own oldest sessions; each process reads a session from the
store at most once a second."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import httpx
import sqlalchemy as sa
from fastapi.testclient import TestClient

from llmgw.control.admin_api import make_admin_app
from llmgw.control.ui import sessions as sessions_module
from llmgw.control.ui.sessions import COOKIE, LIFETIME_S, Principal, Sessions
from llmgw.host import admin_token
from llmgw.host.files import atomic_write
from llmgw.store import Store
from tests.control.ui.conftest import Fleet
from tests.control.ui.test_access import signed_in
from tests.servers import serve_asgi


def _cookie(token: str) -> dict[str, str]:
    return {"Cookie": f"{COOKIE}={token}"}


def _sign_in(url: str, credential: str) -> str:
    r = httpx.post(f"{url}/ui/session", json={"credential": credential}, timeout=10)
    assert r.status_code == 200, r.text
    return r.cookies[COOKIE]


def _stored(store: Store) -> list[dict]:
    """The sessions table's rows, as any control plane of the fleet reads them."""
    return [dict(r) for r in store.db.read(sa.text("SELECT * FROM sessions"))]


def test_a_session_made_on_one_control_plane_is_honoured_by_another_and_ends_on_both(
        fleet: Fleet) -> None:
    """Signed in on a, the cookie reads b; signed out on b, a refuses it once its second
    of trust is over; the store holds the cookie's sha256, never the cookie. (The control: a
    cookie no control plane made is refused by both.)"""
    cookie = _sign_in(fleet.a, fleet.token)
    for url in (fleet.a, fleet.b):
        assert httpx.get(f"{url}/api/v1/nodes", headers=_cookie(cookie)).status_code == 200
        who = httpx.get(f"{url}/ui/session", headers=_cookie(cookie))
        assert who.json() == {"role": "admin", "name": "admin"}
    (row,) = _stored(fleet.store)
    assert row["hash"] == hashlib.sha256(cookie.encode()).hexdigest()
    assert cookie not in repr(row) and fleet.token not in repr(row)
    for url in (fleet.a, fleet.b):
        stranger = httpx.get(f"{url}/api/v1/nodes", headers=_cookie("made-up"))
        assert stranger.status_code == 401, "the control: a cookie nobody made"

    out = httpx.delete(f"{fleet.b}/ui/session", headers=_cookie(cookie))
    assert out.status_code == 204 and "Max-Age=0" in out.headers["set-cookie"]
    assert _stored(fleet.store) == []
    on_b = httpx.get(f"{fleet.b}/api/v1/nodes", headers=_cookie(cookie))
    assert on_b.status_code == 401 and "session has ended" in on_b.json()["detail"]
    time.sleep(sessions_module.CACHE_S)  # a's second of trust in what it read is over
    on_a = httpx.get(f"{fleet.a}/api/v1/nodes", headers=_cookie(cookie))
    assert on_a.status_code == 401 and "signed out" in on_a.json()["detail"]


def test_revoking_a_viewer_key_on_one_control_plane_ends_its_sessions_on_another(
        fleet: Fleet) -> None:
    admin = {"Authorization": f"Bearer {fleet.token}"}
    key = httpx.post(f"{fleet.b}/api/v1/viewers", headers=admin,
                     json={"name": "ops"}).json()["key"]
    cookie = _sign_in(fleet.b, key)
    assert httpx.get(f"{fleet.a}/api/v1/nodes", headers=_cookie(cookie)).status_code == 200
    assert httpx.delete(f"{fleet.b}/api/v1/viewers/ops", headers=admin).status_code == 200
    time.sleep(sessions_module.CACHE_S)
    r = httpx.get(f"{fleet.a}/ui/session", headers=_cookie(cookie))
    assert r.status_code == 401 and "'ops' has been revoked" in r.json()["detail"]
    # Refused on a, and b (a second tab, say) reads the same reason, not "it has ended".
    # The control: before the revocation a read it (above).
    again = httpx.get(f"{fleet.b}/ui/session", headers=_cookie(cookie))
    assert again.status_code == 401 and "'ops' has been revoked" in again.json()["detail"]
    assert len(_stored(fleet.store)) == 1, "kept, refused, until its lifetime ends"


def test_a_session_refused_for_a_new_admin_token_is_forgotten_for_good(
        live_control_plane, tmp_path: Path) -> None:
    """A new admin token ends the sessions of the old one: the one refused (by
    GET /ui/session), and the one not used meanwhile, so putting the old token's hash back
    revives neither. (The control: before the change both read.)"""
    asked, idle = (signed_in(live_control_plane, live_control_plane.token) for _ in range(2))
    for browser in (asked, idle):
        assert browser.get("/api/v1/nodes").status_code == 200
    token_path = tmp_path / "etc" / admin_token.TOKEN_FILE
    hash_path = admin_token.hash_path_for(token_path)
    old_hash = hash_path.read_text()
    token_path.unlink()
    admin_token.ensure(token_path)
    refused = asked.get("/ui/session")
    assert refused.status_code == 401
    atomic_write(hash_path, old_hash, mode=admin_token.HASH_MODE)
    for browser in (asked, idle):
        for path in ("/ui/session", "/api/v1/nodes"):
            r = browser.get(path)
            assert r.status_code == 401, (path, r.text)
            assert "session has ended" in r.json()["detail"]
    assert "admin token has changed" in refused.json()["detail"], "it said why, once"
    assert _stored(live_control_plane.store) == []
    old = TestClient(live_control_plane.app,
                     headers={"Authorization": f"Bearer {live_control_plane.token}"})
    assert old.get("/api/v1/nodes").status_code == 200, "the old token itself works again"


def test_ten_thousand_viewer_sign_ins_leave_an_admins_session(tmp_path: Path) -> None:
    """A viewer key signing in 10,001 times ends only its own oldest sessions: the admin's
    reads on, the viewer key keeps its newest PER_CREDENTIAL. The first and last sign-ins go
    through the page's sign-in on a real server, the 10,000 between through the same
    Sessions.open it calls (over HTTP they would take 90 s on the test machines). (The
    control: the viewer key's first session is among those ended.)"""
    token_path = tmp_path / "etc" / admin_token.TOKEN_FILE
    admin_token.ensure(token_path)
    store = Store(tmp_path / "control.db")
    sessions = Sessions(store)
    app = make_admin_app(store, node_timeout_s=30.0,
                         token_hash=admin_token.hash_path_for(token_path), sessions=sessions)
    admin = {"Authorization": f"Bearer {admin_token.read_token(token_path)}"}
    with serve_asgi(app) as url:
        admin_cookie = _sign_in(url, admin_token.read_token(token_path))
        key = httpx.post(f"{url}/api/v1/viewers", headers=admin,
                         json={"name": "ops"}).json()["key"]
        first = _sign_in(url, key)
        viewer = store.viewer_by_hash(hashlib.sha256(key.encode()).hexdigest())
        assert viewer is not None
        for _ in range(sessions_module.MAX_SESSIONS):
            sessions.open(Principal("viewer", "ops", viewer["hash"], True))
        last = _sign_in(url, key)
        who = httpx.get(f"{url}/ui/session", headers=_cookie(admin_cookie))
        assert who.json() == {"role": "admin", "name": "admin"}
        assert httpx.get(f"{url}/api/v1/nodes", headers=_cookie(admin_cookie)).status_code == 200
        assert httpx.get(f"{url}/ui/session", headers=_cookie(last)).status_code == 200
        refused = httpx.get(f"{url}/api/v1/nodes", headers=_cookie(first))
        assert refused.status_code == 401, "the control: the viewer key's own oldest went"
    roles = [r["role"] for r in _stored(store)]
    assert roles.count("viewer") == sessions_module.PER_CREDENTIAL and roles.count("admin") == 1
    store.close()


def test_a_session_ends_when_its_lifetime_does(tmp_path: Path) -> None:
    now = [1000.0]
    store = Store(tmp_path / "control.db", clock=lambda: now[0])
    sessions = Sessions(store, cache_s=0.0)
    token = sessions.open(Principal("viewer", "ops", "h", True))
    found = sessions.find(token)
    assert found is not None and found.expires == 1000.0 + LIFETIME_S
    assert sessions.find("made-up") is None
    store.close()


def test_a_session_is_read_from_the_store_at_most_once_a_second(live_control_plane) -> None:
    """Per request a session costs a dict lookup; the store is asked again once a second.
    (The control: after that second, it is asked.)"""
    browser = signed_in(live_control_plane, live_control_plane.token)
    store = live_control_plane.store
    reads = []
    real = store.session
    store.session = lambda digest: reads.append(digest) or real(digest)  # type: ignore[method-assign]
    for _ in range(20):
        assert browser.get("/api/v1/nodes").status_code == 200
    assert len(reads) <= 1, f"{len(reads)} store reads for 20 requests within a second"


def test_a_store_outage_refuses_a_session_with_503_and_ends_none(
        postgres_url: str, tmp_path: Path) -> None:
    """With the store cut off, a session cannot be checked: 503 saying so and what to use
    meanwhile, never a 401; healed, the same session reads again (an outage is no refusal,
    so nothing was forgotten). (The control: before the cut it reads.)"""
    from tests.control.test_store_split import split_stores

    token_path = tmp_path / "etc" / admin_token.TOKEN_FILE
    admin_token.ensure(token_path)
    with split_stores(postgres_url) as (store, _, cable, _):
        app = make_admin_app(store, node_timeout_s=30.0,
                             token_hash=admin_token.hash_path_for(token_path),
                             sessions=Sessions(store, cache_s=0.0))
        browser = TestClient(app)
        signing = browser.post("/ui/session", json={"credential": token_path.read_text()})
        assert signing.status_code == 200, signing.text
        assert browser.get("/api/v1/drift").status_code == 200, "the control"
        cable.cut()
        r = browser.get("/api/v1/drift")  # a path the store does not serve
        assert r.status_code == 503, r.text
        assert "fleet-page session cannot be checked while the store is away" in r.text
        assert "use the admin token as a bearer" in r.text
        cable.mend()
        assert browser.get("/api/v1/drift").status_code == 200
        assert browser.get("/ui/session").json() == {"role": "admin", "name": "admin"}
