"""The admin token: made once and private, its hash beside it, checked in constant time."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from starlette.websockets import WebSocket, WebSocketDisconnect

from llmgw.host import admin_token
from llmgw.host.admin_token import AdminTokenError, RequireAdminToken
from llmgw.host.files import file_mode
from llmgw.host.layout import Layout


def test_ensure_makes_a_private_token_and_a_readable_hash_once(tmp_path: Path) -> None:
    layout = Layout.for_mode("local", tmp_path)
    made = admin_token.ensure(layout.admin_token)
    assert len(made) == 2 and str(layout.admin_token) in made[0]
    assert file_mode(layout.admin_token) == 0o600
    assert file_mode(layout.admin_token_hash) == 0o644
    token = admin_token.read_token(layout.admin_token)
    assert len(token) >= 40
    # The hash file format that running services read: the sha256 of the token, in hex.
    assert layout.admin_token_hash.read_text().strip() == hashlib.sha256(token.encode()).hexdigest()
    assert admin_token.ensure(layout.admin_token) == [], "a second run changes nothing"
    assert admin_token.read_token(layout.admin_token) == token, "never overwritten"
    assert admin_token.file_problem(layout.admin_token) == ""


def test_a_lost_or_wrong_hash_is_written_again_from_the_token(tmp_path: Path) -> None:
    layout = Layout.for_mode("local", tmp_path)
    admin_token.ensure(layout.admin_token)
    token = admin_token.read_token(layout.admin_token)
    layout.admin_token_hash.write_text("0" * 64)
    assert "does not hold the sha256" in admin_token.file_problem(layout.admin_token)
    assert admin_token.ensure(layout.admin_token) != []
    assert admin_token.read_token(layout.admin_token) == token
    assert admin_token.file_problem(layout.admin_token) == ""


def test_file_problem_names_a_readable_token_and_a_missing_one(tmp_path: Path) -> None:
    path = tmp_path / "admin-token"
    assert "missing" in admin_token.file_problem(path)
    admin_token.ensure(path)
    path.chmod(0o644)
    assert "chmod 600" in admin_token.file_problem(path)


def test_read_token_names_the_file_when_it_cannot(tmp_path: Path) -> None:
    with pytest.raises(AdminTokenError, match=f"{tmp_path}/admin-token does not exist"):
        admin_token.read_token(tmp_path / "admin-token")
    (tmp_path / "admin-token").write_text("\n")
    with pytest.raises(AdminTokenError, match="is empty"):
        admin_token.read_token(tmp_path / "admin-token")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to another uid")
def test_another_user_cannot_read_it_and_is_told_why(tmp_path: Path) -> None:
    path = tmp_path / "admin-token"
    admin_token.ensure(path)
    tmp_path.chmod(0o755)
    pid = os.fork()
    if pid == 0:  # the child becomes nobody and tries
        code = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            admin_token.read_token(path)
        except AdminTokenError as e:
            code = 0 if "cannot read the admin token" in str(e) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def _app(hash_path: Path | None) -> TestClient:
    app = FastAPI()
    app.add_middleware(RequireAdminToken, hash_path=hash_path)

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/secret")
    def secret() -> dict[str, str]:
        return {"secret": "yes"}

    return TestClient(app)


def test_the_middleware_lets_the_token_in_and_nothing_else(tmp_path: Path) -> None:
    path = tmp_path / "admin-token"
    admin_token.ensure(path)
    token = admin_token.read_token(path)
    client = _app(admin_token.hash_path_for(path))
    assert client.get("/secret", headers={"Authorization": f"Bearer {token}"}).status_code == 200
    assert client.get("/secret", headers={"Authorization": f"bearer {token}"}).status_code == 200
    for bad in ({}, {"Authorization": "Bearer x"}, {"Authorization": token},
                {"Authorization": f"Bearer {token}x"}):
        r = client.get("/secret", headers=bad)
        assert r.status_code == 401 and str(path) in r.json()["detail"], (bad, r.text)
        assert r.headers["www-authenticate"].startswith("Bearer")
    assert client.get("/health").status_code == 200


def test_a_service_without_a_hash_refuses_everything_but_health(tmp_path: Path) -> None:
    for hash_path in (None, tmp_path / "missing.sha256"):
        client = _app(hash_path)
        r = client.get("/secret", headers={"Authorization": "Bearer anything"})
        assert r.status_code == 401 and "pytest provision/" in r.json()["detail"]
        assert client.get("/health").status_code == 200


def test_a_token_made_after_the_service_started_is_taken_up(tmp_path: Path) -> None:
    path = tmp_path / "admin-token"
    client = _app(admin_token.hash_path_for(path))
    assert client.get("/secret", headers={"Authorization": "Bearer x"}).status_code == 401
    admin_token.ensure(path)
    auth = {"Authorization": f"Bearer {admin_token.read_token(path)}"}
    assert client.get("/secret", headers=auth).status_code == 200


def test_websockets_need_the_token_too(tmp_path: Path) -> None:
    path = tmp_path / "admin-token"
    admin_token.ensure(path)
    app = FastAPI()
    app.add_middleware(RequireAdminToken, hash_path=admin_token.hash_path_for(path))

    @app.websocket("/ws")
    async def ws(socket: WebSocket) -> None:
        await socket.accept()
        await socket.send_text("in")
        await socket.close()

    client = TestClient(app)
    with pytest.raises(WebSocketDisconnect):
        with client.websocket_connect("/ws") as s:
            s.receive_text()
    auth = {"Authorization": f"Bearer {admin_token.read_token(path)}"}
    with client.websocket_connect("/ws", headers=auth) as s:
        assert s.receive_text() == "in"
