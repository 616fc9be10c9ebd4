"""The admin credential: a random token only its owner can read, and the hash the services
hold to check it without being able to read it.

ETC/admin-token          the token (mode 0600, the provisioning user's): clients read it
ETC/admin-token.sha256   its sha256 in hex (mode 0644): the services read it, and the
                         mirror's user can too; a hash of 256 random bits gives nothing away

The services re-read the hash file when it changes, so a token made after they started
is taken up without a restart.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmgw.contract.secret import Secret, digest, matches
from llmgw.errors import Error
from llmgw.host.files import atomic_write, file_mode

TOKEN_FILE = "admin-token"
HASH_FILE = "admin-token.sha256"
TOKEN_MODE = 0o600
HASH_MODE = 0o644
# Paths anyone may ask: a health probe proves nothing and changes nothing.
OPEN_PATHS = frozenset({"/health", "/healthz"})


class AdminTokenError(Error):
    """The admin token or its hash is missing or cannot be read."""


def hash_path_for(token_path: Path) -> Path:
    """The hash file beside a token file (the convention every service falls back to)."""
    return token_path.with_name(HASH_FILE)


def server_hash_path(config_path: Path, configured: str) -> Path:
    """The hash file the control plane checks: server.yaml's admin_token_hash, else the
    one beside server.yaml."""
    return Path(configured) if configured else config_path.with_name(HASH_FILE)


def ensure(token_path: Path) -> list[str]:
    """Make the token (once, never overwritten) and its hash file; what was done, one line
    each (empty when both were already right)."""
    done = []
    if not token_path.exists():
        atomic_write(token_path, Secret.new().text + "\n", mode=TOKEN_MODE)
        done.append(f"admin token in {token_path} (mode 0600; clients send it as a bearer token)")
    hash_path = hash_path_for(token_path)
    want = digest(read_token(token_path)) + "\n"
    if _text_or_none(hash_path) != want or file_mode(hash_path) != HASH_MODE:
        atomic_write(hash_path, want, mode=HASH_MODE)
        done.append(f"admin token hash in {hash_path}, for the services to check it")
    return done


def read_token(token_path: Path) -> str:
    """The token, for a client; AdminTokenError naming the file when it cannot be read."""
    try:
        token = token_path.read_text().strip()
    except FileNotFoundError:
        raise AdminTokenError(
            f"the admin token {token_path} does not exist; run `pytest provision/` on this "
            "host to make one"
        ) from None
    except PermissionError:
        raise AdminTokenError(
            f"cannot read the admin token {token_path} (mode 0600, its owner's only): managing "
            "this host needs it; run this as the user who provisioned the host (root in system "
            "mode)"
        ) from None
    except OSError as e:
        raise AdminTokenError(f"cannot read the admin token {token_path}: {e}") from e
    if not token:
        raise AdminTokenError(f"the admin token {token_path} is empty; delete it and run "
                              "`pytest provision/` to make a new one")
    return token


def _text_or_none(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


class Verifier:
    """Checks a presented bearer token against the hash file, re-read when it changes."""

    def __init__(self, hash_path: Path | None) -> None:
        self.hash_path = hash_path
        self._seen: tuple[int, int, int] | None = None
        self._hash = ""

    def _current(self) -> str:
        if self.hash_path is None:
            return ""
        try:
            st = os.stat(self.hash_path)
        except OSError:
            return ""
        seen = (st.st_mtime_ns, st.st_ino, st.st_size)
        if seen != self._seen:
            text = _text_or_none(self.hash_path) or ""
            self._hash, self._seen = text.strip().lower(), seen
        return self._hash

    def current_hash(self) -> str:
        """The hash the token is checked against now ('' when there is none)."""
        return self._current()

    def problem(self, authorization: str | None) -> str:
        """'' when authorization carries the token; else why it is refused."""
        expected = self._current()
        if not expected:
            where = self.hash_path or "(no --admin-token-hash given)"
            return (f"this service has no admin token hash to check against ({where} is "
                    "missing or empty), so it refuses every request; run `pytest provision/` "
                    "to make the token and its hash")
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return "no admin token was sent"
        if not matches(token.strip(), expected):
            return "the admin token sent is not this host's"
        return ""


ASGIApp = Callable[
    [MutableMapping[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
    Awaitable[None],
]


class RequireAdminToken:
    """ASGI middleware: every HTTP path but the health ones needs the admin token, so a route
    added later (or an app mounted inside) is covered without asking."""

    def __init__(self, app: ASGIApp, *, hash_path: Path | None) -> None:
        self.app = app
        self.verifier = Verifier(hash_path)
        self.token_path = hash_path.with_name(TOKEN_FILE) if hash_path else None

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        header = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        why = self.verifier.problem(header)
        if not why:
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": why})
        else:
            await _refuse(send, f"{why}. {self.how_to()}")

    def how_to(self) -> str:
        where = self.token_path or "the admin-token file beside server.yaml"
        return (f"Send `Authorization: Bearer <token>`, the token being the content of {where} "
                f"(readable by its owner only), e.g. curl -H \"Authorization: Bearer $(cat "
                f"{where})\" ...")


async def _refuse(send: Any, message: str, status: int = 401) -> None:
    body = json.dumps({"detail": message}).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="llmgw admin"'))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@dataclass(frozen=True)
class TokenFinding:
    """What is wrong with the admin token's files (and why), and what a person runs."""

    found: str
    todo: str

    def __str__(self) -> str:
        return f"{self.found}; {self.todo}"


def token_finding(token_path: Path) -> TokenFinding | None:
    """None when the token is private (0600) and its hash file matches it."""
    mode = file_mode(token_path)
    if mode is None:
        return TokenFinding(f"{token_path} is missing",
                            "run `pytest provision/` to make the admin token")
    if mode != TOKEN_MODE:
        return TokenFinding(f"the admin token {token_path} has mode {mode:o}, so others on "
                            "this machine can read it and manage the host",
                            f"run `chmod 600 {token_path}`")
    hash_path = hash_path_for(token_path)
    if (_text_or_none(hash_path) or "").strip() != digest(read_token(token_path)):
        return TokenFinding(f"{hash_path} does not hold the sha256 of {token_path}, so the "
                            "services refuse that token",
                            "run `pytest provision/` to write it again")
    return None


def file_problem(token_path: Path) -> str:
    """'' when the token's files are right; else what is wrong and what to do, in a line."""
    finding = token_finding(token_path)
    return str(finding) if finding else ""


def anonymous_answer(url: str) -> str:
    """'' when url refuses a request without a token (401); else what it answered."""
    import httpx

    from llmgw import httpclient

    try:
        r = httpclient.request("GET", url, timeout=5.0)
    except httpx.HTTPError as e:
        return f"no answer ({httpclient.reason(e)})"
    if r.status_code == 401:
        return ""
    return f"{r.status_code} {r.text[:200]!r}"
