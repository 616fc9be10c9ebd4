"""The admin API's access with the fleet page: the admin token may do anything; a viewer
key, and a page session made by signing in, read (GET) and are refused every write with
403 saying why; without either, the page's files and sign-in only, every JSON path 401.
Sessions are the control plane's: signing out, revoking the viewer key or changing the
admin token ends them, whatever cookie the browser still holds."""

from __future__ import annotations

import re
import time

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from llmgw.control.ui.sessions import COOKIE
from llmgw.host import admin_token

MODEL = {"name": "tiny", "source": "http://127.0.0.1:8081/tiny/1/tiny.gguf",
         "profiles": [{"name": "cpu", "engine": "llamacpp", "priority": 100}]}


def viewer_key(cp, name: str = "ops") -> str:
    made = cp.admin.post("/api/v1/viewers", json={"name": name})
    assert made.status_code == 201, made.text
    assert made.json()["key"].startswith("vk-llmgw-") and "hash" not in made.json()
    return made.json()["key"]


def signed_in(cp, credential: str, base_url: str = "http://testserver") -> TestClient:
    browser = TestClient(cp.app, base_url=base_url)
    r = browser.post("/ui/session", json={"credential": credential})
    assert r.status_code == 200, r.text
    return browser


def writes(app) -> list[tuple[str, str]]:
    """Every route of the admin API that changes something (not a GET), path parameters
    filled in, but the page's sign-in and sign-out (open by design)."""
    out = []
    for route in app.routes:
        if isinstance(route, APIRoute) and not route.path.startswith("/ui"):
            for method in sorted(route.methods - {"GET", "HEAD"}):
                out.append((method, re.sub(r"\{[^}]+\}", "x", route.path)))
    return out


def test_without_a_session_the_page_and_sign_in_answer_and_no_data_does(
        live_control_plane) -> None:
    anon = live_control_plane.anonymous()
    page = anon.get("/ui/")
    assert page.status_code == 200 and "sign-in-form" in page.text
    assert anon.get("/ui/app.js").status_code == 200
    assert anon.get("/ui", follow_redirects=False).headers["location"] == "/ui/"
    assert anon.get("/ui/session").status_code == 401
    for path in ("/api/v1/nodes", "/api/v1/models", "/api/v1/replicas", "/api/v1/keys",
                 "/api/v1/drift", "/api/v1/traffic", "/api/v1/viewers", "/metrics"):
        r = anon.get(path)
        assert r.status_code == 401, (path, r.text)
        assert "sign in at /ui/" in r.json()["detail"]
    # The control: the same paths answer the admin token.
    assert live_control_plane.admin.get("/api/v1/nodes").status_code == 200


def test_a_wrong_credential_signs_nobody_in(live_control_plane) -> None:
    browser = live_control_plane.anonymous()
    for wrong in ("nope", "vk-llmgw-00000000-" + "a" * 43, live_control_plane.token + "x"):
        r = browser.post("/ui/session", json={"credential": wrong})
        assert r.status_code == 401 and "set-cookie" not in r.headers
        assert "llmgw keys create --viewer" in r.json()["detail"]
    assert browser.get("/api/v1/nodes").status_code == 401


def test_signing_in_makes_a_cookie_scripts_and_other_sites_never_get(
        live_control_plane) -> None:
    r = live_control_plane.anonymous().post("/ui/session",
                                            json={"credential": live_control_plane.token})
    assert r.json() == {"role": "admin", "name": "admin"}
    cookie = r.headers["set-cookie"]
    assert cookie.startswith(f"{COOKIE}=")
    for attribute in ("HttpOnly", "SameSite=Strict", "Path=/"):
        assert attribute in cookie, cookie
    assert "Secure" not in cookie  # plain HTTP: a Secure cookie would never come back
    over_tls = TestClient(live_control_plane.app, base_url="https://testserver").post(
        "/ui/session", json={"credential": live_control_plane.token})
    assert "; Secure" in over_tls.headers["set-cookie"]


def test_an_admin_session_reads_and_cannot_write(live_control_plane) -> None:
    browser = signed_in(live_control_plane, live_control_plane.token)
    assert browser.get("/ui/session").json() == {"role": "admin", "name": "admin"}
    assert browser.get("/api/v1/nodes").status_code == 200
    refused = browser.post("/api/v1/models", json=MODEL)
    assert refused.status_code == 403
    assert "session only reads" in refused.json()["detail"]
    assert "Authorization: Bearer" in refused.json()["detail"]
    assert live_control_plane.admin.get("/api/v1/models").json() == []
    # The control: the admin token as a bearer writes.
    assert live_control_plane.admin.post("/api/v1/models", json=MODEL).status_code == 201


def test_signing_out_ends_the_session_on_the_server(live_control_plane) -> None:
    browser = signed_in(live_control_plane, live_control_plane.token)
    kept = browser.cookies[COOKIE]
    out = browser.delete("/ui/session")
    assert out.status_code == 204 and "Max-Age=0" in out.headers["set-cookie"]
    # A browser that kept the old cookie anyway is refused: the session was forgotten.
    replay = live_control_plane.anonymous()
    replay.cookies.set(COOKIE, kept)
    r = replay.get("/api/v1/nodes")
    assert r.status_code == 401 and "session has ended" in r.json()["detail"]


def test_a_viewer_key_reads_everything_the_page_shows_and_never_a_secret(
        live_control_plane) -> None:
    key = viewer_key(live_control_plane)
    live_control_plane.admin.post("/api/v1/keys", json={"name": "app"})
    viewer = TestClient(live_control_plane.app, headers={"Authorization": f"Bearer {key}"})
    for path in ("/api/v1/nodes", "/api/v1/models", "/api/v1/replicas", "/api/v1/drift",
                 "/api/v1/keys", "/api/v1/viewers", "/api/v1/traffic"):
        assert viewer.get(path).status_code == 200, path
    listed = viewer.get("/api/v1/keys").json() + viewer.get("/api/v1/viewers").json()
    assert listed and not any("hash" in k or "key" in k for k in listed)
    browser = signed_in(live_control_plane, key)
    assert browser.get("/ui/session").json() == {"role": "viewer", "name": "ops"}
    assert browser.get("/api/v1/nodes").status_code == 200


def test_a_viewer_key_is_refused_every_write_with_403_saying_why(live_control_plane) -> None:
    key = viewer_key(live_control_plane)
    live_control_plane.admin.post("/api/v1/models", json=MODEL)
    routes = writes(live_control_plane.app)
    assert ("POST", "/api/v1/models") in routes and ("DELETE", "/api/v1/viewers/x") in routes
    viewer = TestClient(live_control_plane.app, headers={"Authorization": f"Bearer {key}"})
    browser = signed_in(live_control_plane, key)
    for client in (viewer, browser):
        for method, path in routes + [("DELETE", "/api/v1/models/tiny")]:
            r = client.request(method, path, json={})
            assert r.status_code == 403, (method, path, r.status_code)
            assert "viewer key 'ops' only reads" in r.json()["detail"], r.text
    assert [m["name"] for m in live_control_plane.admin.get("/api/v1/models").json()] == ["tiny"]
    # The control: the admin token passes the same gate (the route answers for itself).
    r = live_control_plane.admin.delete("/api/v1/models/tiny")
    assert r.status_code == 204


def test_revoking_a_viewer_key_ends_its_sessions(live_control_plane) -> None:
    key = viewer_key(live_control_plane)
    browser = signed_in(live_control_plane, key)
    assert browser.get("/api/v1/nodes").status_code == 200
    assert live_control_plane.admin.delete("/api/v1/viewers/ops").status_code == 200
    r = browser.get("/api/v1/nodes")
    assert r.status_code == 401 and "'ops' has been revoked" in r.json()["detail"]
    bearer = TestClient(live_control_plane.app, headers={"Authorization": f"Bearer {key}"})
    assert bearer.get("/api/v1/nodes").status_code == 401


def test_a_new_admin_token_ends_the_sessions_signed_in_with_the_old(
        live_control_plane, tmp_path) -> None:
    browser = signed_in(live_control_plane, live_control_plane.token)
    assert browser.get("/api/v1/nodes").status_code == 200
    token_path = tmp_path / "etc" / admin_token.TOKEN_FILE
    token_path.unlink()
    admin_token.ensure(token_path)
    r = browser.get("/api/v1/nodes")
    assert r.status_code == 401 and "admin token has changed" in r.json()["detail"]


def test_every_answer_carries_the_page_s_security_headers(live_control_plane) -> None:
    for r in (live_control_plane.anonymous().get("/ui/"),
              live_control_plane.anonymous().get("/api/v1/nodes"),
              live_control_plane.admin.get("/api/v1/nodes")):
        csp = r.headers["content-security-policy"]
        assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp
        assert "unsafe-inline" not in csp and "script-src 'self'" in csp
        assert r.headers["x-content-type-options"] == "nosniff"


def test_a_viewer_key_past_its_expiry_is_refused_saying_when_and_what_to_do(
        live_control_plane) -> None:
    """A viewer key made with expires reads until then; after it, as a bearer, at sign-in
    and through a session made before, it is 401 naming the time it expired and how to get
    another, and the session says so each time it is asked (it is kept, refused, until its
    lifetime ends). (The control: a key expiring later still reads at the same moment.)"""
    now = time.time()
    admin = live_control_plane.admin
    made = admin.post("/api/v1/viewers", json={"name": "ops", "expires": now + 60})
    assert made.status_code == 201 and made.json()["expires"] == now + 60
    later = admin.post("/api/v1/viewers", json={"name": "later", "expires": now + 3600})
    key, lasting = made.json()["key"], later.json()["key"]
    assert [v["expires"] for v in admin.get("/api/v1/viewers").json()] == [now + 60, now + 3600]
    browser = signed_in(live_control_plane, key)
    assert browser.get("/api/v1/nodes").status_code == 200

    live_control_plane.store.clock = lambda: now + 120
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(now + 60))
    bearer = TestClient(live_control_plane.app, headers={"Authorization": f"Bearer {key}"})
    again = live_control_plane.anonymous().post("/ui/session", json={"credential": key})
    for r in (bearer.get("/api/v1/nodes"), browser.get("/api/v1/nodes"), again):
        assert r.status_code == 401, r.text
        assert f"'ops' expired at {when}" in r.json()["detail"]
        assert "llmgw keys create --viewer" in r.json()["detail"]
    for _ in range(2):
        r = browser.get("/ui/session")
        assert r.status_code == 401 and f"'ops' expired at {when}" in r.json()["detail"]
    still = TestClient(live_control_plane.app, headers={"Authorization": f"Bearer {lasting}"})
    assert still.get("/api/v1/nodes").status_code == 200, "the control: not yet expired"
    past = admin.post("/api/v1/viewers", json={"name": "late", "expires": now + 90})
    assert past.status_code == 422 and "in the past" in past.json()["detail"]


@pytest.mark.parametrize("name", ["<b>x</b>", "a b", ""])
def test_a_viewer_key_name_is_checked_as_a_gateway_key_s(live_control_plane, name) -> None:
    r = live_control_plane.admin.post("/api/v1/viewers", json={"name": name})
    if name:
        assert r.status_code == 422 and "is not allowed" in r.json()["detail"]
    else:
        assert r.status_code == 201 and r.json()["name"].startswith("viewer-")


def test_another_site_s_page_cannot_sign_a_browser_in_or_out(live_control_plane) -> None:
    browser = live_control_plane.anonymous()
    elsewhere = {"Origin": "https://evil.example"}
    r = browser.post("/ui/session", json={"credential": live_control_plane.token},
                     headers=elsewhere)
    assert r.status_code == 403 and "set-cookie" not in r.headers
    assert "evil.example" in r.json()["detail"]
    # The control: the page's own origin signs in, and only it signs out.
    r = browser.post("/ui/session", json={"credential": live_control_plane.token},
                     headers={"Origin": "http://testserver"})
    assert r.status_code == 200
    assert browser.delete("/ui/session", headers=elsewhere).status_code == 403
    assert browser.get("/api/v1/nodes").status_code == 200
