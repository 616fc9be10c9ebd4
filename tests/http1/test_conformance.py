"""The HTTP core against an external corpus: gunicorn's request vectors
(tests/http1/corpus/gunicorn, MIT; source, commit and licence in corpus/NOTICE).

Each vector is fed to a real Http1Server on loopback three ways: whole, byte by byte, and
split at random points (seeded). A valid one must reach the app as the vector says (method,
target, version, headers, body; each request of a pipelined run); an invalid one must be
answered with a 4xx or 5xx, or the connection closed, and the app never called.

Vectors whose verdict depends on gunicorn's own settings or limits are skipped, each kind
listed in SKIPPED and each single one in SKIPPED_VECTORS, with why. A valid vector that
breaks a rule RFC 9110/9112 sets a server (no Host in HTTP/1.1, Content-Length with
Transfer-Encoding, a coding other than chunked, CONNECT, a raw non-ASCII target: gunicorn
takes them by default) is held to the RFC's verdict instead (rfc_refusal)."""

from __future__ import annotations

import json
import random
import re
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from tests.http1.servers import running
from tests.http1.wire import answer, read_body

CORPUS = Path(__file__).parent / "corpus" / "gunicorn"
SEED = 20261203

# Verdicts gunicorn's configuration decides, not HTTP's.
SKIPPED = {
    "cfg": "the vector sets a gunicorn setting (cfg.set): its verdict is that setting's",
    "LimitRequestHeaders": "gunicorn's own header count/size limits (this core's are "
                           "Limits.max_headers and max_head_bytes, tested on their own)",
    "LimitRequestLine": "gunicorn's request-line limit (4094 bytes); this core's is the "
                        "head limit, tested on its own",
    "InvalidProxyLine": "the PROXY protocol, which this core does not speak",
    "InvalidSchemeHeaders": "gunicorn's forwarded-scheme headers policy",
}
# Single vectors skipped, and why.
SKIPPED_VECTORS = {
    "valid/040": "gunicorn drops header names with '_' by default (header_map); RFC 9110 "
                 "allows them, and this core hands them on",
    "valid/099": "its Content-Length (17914) is more than the body it holds (8599 bytes): "
                 "a server waits for the rest",
    "invalid/041": "two Content-Type lines: RFC 9110 5.3 lets a server take them (the app "
                   "sees both); gunicorn refuses them",
    "invalid/chunked_05": "HTTP/1.0 with a chunked body: RFC 9112 6.1 says process it, then "
                          "close (tests/http1/test_framing.py holds that); gunicorn refuses it",
    "invalid/rfc9110_trailer_forbidden_host_01": "this core drops trailer fields, never "
                                                 "merging them into the head (RFC 9110 6.5); "
                                                 "gunicorn refuses a Host among them",
}


def _decode(raw: bytes) -> bytes:
    """The vector's bytes, as gunicorn's tests/treq.py decodes them."""
    data = raw.replace(b"\n", b"").replace(b"\\r\\n", b"\r\n")
    data = data.replace(b"\\0", b"\000").replace(b"\\n", b"\n").replace(b"\\t", b"\t")
    return re.sub(rb"\\x([0-9A-Fa-f]{2})", lambda m: bytes([int(m[1], 16)]), data)


class _Names(dict):  # type: ignore[type-arg]
    """The .py's namespace: an error class it imports from gunicorn stands for its name."""

    def __missing__(self, key: str) -> str:
        return key


class _Cfg:
    def __init__(self) -> None:
        self.settings: dict[str, Any] = {}

    def set(self, name: str, value: Any) -> None:
        self.settings[name] = value


def load(name: str) -> tuple[bytes, Any, dict[str, Any]]:
    """A vector's bytes, what gunicorn expects (an error's name, or requests) and the
    settings it sets."""
    source = (CORPUS / f"{name}.py").read_text()
    code = "\n".join(line for line in source.splitlines()
                     if not line.startswith(("from gunicorn", "import gunicorn"))
                     and line.strip() != "cfg = Config()")
    cfg = _Cfg()
    names = _Names(uri=lambda raw: {"raw": raw}, cfg=cfg)
    exec(compile(code, f"{name}.py", "exec"), {"__builtins__": __builtins__}, names)  # noqa: S102
    return _decode((CORPUS / f"{name}.http").read_bytes()), names["request"], cfg.settings


def vectors(kind: str) -> list[Any]:
    params = []
    for http in sorted((CORPUS / kind).glob("*.http")):
        name = f"{kind}/{http.stem}"
        _, expect, settings = load(name)
        why = SKIPPED["cfg"] if settings else SKIPPED.get(str(expect).strip())
        why = SKIPPED_VECTORS.get(name, why)
        marks = [pytest.mark.skip(reason=why)] if why else []
        params.append(pytest.param(name, id=name, marks=marks))
    return params


class Echo:
    """Answers each request with what reached it, as JSON; records the calls."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body, _ = await read_body(receive)
        seen = {"method": scope["method"], "path": scope["raw_path"].decode("latin-1"),
                "query": scope["query_string"].decode("latin-1"),
                "version": scope["http_version"],
                "headers": [(k.decode("latin-1").lower(), v.decode("latin-1"))
                            for k, v in scope["headers"]],
                "body": body.decode("latin-1")}
        self.seen.append(seen)
        await answer(send, json.dumps(seen).encode())


def pieces(data: bytes, how: str, rng: random.Random) -> list[bytes]:
    if how == "whole":
        return [data]
    if how == "bytes":
        return [data[i:i + 1] for i in range(len(data))]
    cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, 8)))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]


def feed(port: int, parts: list[bytes], answers: int = 0,
         then_close: bool = False) -> tuple[bytes, bool]:
    """Send parts one by one (a pause between, so each is its own read), then read until
    the server closes, is quiet for a second, or (answers) sent that many answers: what
    came, and whether it closed."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            for part in parts:
                sock.sendall(part)
                if len(parts) > 1:
                    time.sleep(0.0005)
        except (BrokenPipeError, ConnectionResetError):
            pass
        if then_close:  # the client has no more to send (gunicorn's NoMoreData)
            try:
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        got = b""
        sock.settimeout(1.0)
        while True:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                return got, False
            except ConnectionResetError:
                return got, True
            if not chunk:
                return got, True
            got += chunk
            if answers and len(statuses(got)) >= answers and _whole(got):
                return got, False


def _whole(data: bytes) -> bool:
    """Whether the last answer in data is complete (its body as long as it says)."""
    head, sep, body = data.rpartition(b"HTTP/1.1 ")[2].partition(b"\r\n\r\n")
    found = re.search(rb"content-length: (\d+)", head)
    return bool(sep) and found is not None and len(body) >= int(found[1])


def statuses(data: bytes) -> list[int]:
    return [int(m[1]) for m in re.finditer(rb"HTTP/1\.1 (\d{3}) ", data)]


HOW = ["whole", "bytes", "random"]


def _expected(request: dict[str, Any]) -> dict[str, Any]:
    raw = request["uri"]["raw"]
    if "://" in raw.partition("?")[0]:  # absolute-form: the app sees its path (RFC 9112 3.2.2)
        raw = "/" + raw.split("://", 1)[1].partition("/")[2]
    path, _, query = raw.partition("?")
    query = query.partition("#")[0]
    return {"method": request["method"], "path": path.partition("#")[0], "query": query,
            "version": "{}.{}".format(*request["version"]),
            "headers": [(k.lower(), v) for k, v in request["headers"]],
            "body": request["body"].decode("latin-1") if isinstance(request["body"], bytes)
            else request["body"]}


def rfc_refusal(requests: list[dict[str, Any]]) -> tuple[set[int], str] | None:
    """Where a vector gunicorn takes breaks a rule RFC 9112 sets a server, the statuses
    that rule asks for and the rule; None where it breaks none."""
    for request in requests:
        if request["method"] == "CONNECT":
            return {501}, ("RFC 9110 15.6.2: a server that does not implement a method (CONNECT: "
                           "this is no proxy) answers 501")
        if any(ord(c) > 0x7F for c in request["uri"]["raw"]):
            return {400}, ("RFC 9112 3.2 / RFC 3986: a request-target is ASCII; a raw byte "
                           "above 0x7F is refused (400)")
        names = [k.lower() for k, _ in request["headers"]]
        codings = [c.strip().lower() for k, v in request["headers"]
                   if k.lower() == "transfer-encoding" for c in v.split(",")]
        if request["version"] == (1, 1) and names.count("host") != 1:
            return {400}, "RFC 9112 3.2: an HTTP/1.1 request needs exactly one Host (400)"
        if codings and "content-length" in names:
            return {400}, ("RFC 9112 6.3: a body framed by both Transfer-Encoding and "
                           "Content-Length is an error (400)")
        if codings and codings != ["chunked"]:
            return {400, 501}, ("RFC 9112 6.1: a transfer coding other than chunked alone "
                                "is not decoded here (501; 400 when chunked is not last)")
    return None


@pytest.fixture(scope="module")
def served() -> Any:
    """Module: one server for every vector (each test reads what its own requests did)."""
    app = Echo()
    with running(app) as (_, _, port):
        yield app, port


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("name", vectors("valid"))
def test_a_valid_vector_reaches_the_app_as_it_was_sent(served: Any, name: str,
                                                       how: str) -> None:
    data, expect, _ = load(name)
    requests = expect if isinstance(expect, list) else [expect]
    app, port = served
    app.seen.clear()
    refusal = rfc_refusal(requests)
    got, _ = feed(port, pieces(data, how, random.Random(f"{SEED}{name}{how}")),
                  answers=0 if refusal else len(requests))
    if refusal is not None:  # the RFC's verdict, not gunicorn's: refused, before the app
        allowed, why = refusal
        processed = app.seen[:len(app.seen)]
        assert statuses(got)[len(processed):][:1] and \
            statuses(got)[len(processed)] in allowed, (why, got[:300])
        assert processed == [_expected(r) for r in requests[:len(processed)]]
        return
    assert statuses(got) == [200] * len(requests), got[:500]
    assert app.seen == [_expected(r) for r in requests]


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("name", vectors("invalid"))
def test_an_invalid_vector_is_refused_and_nothing_is_processed(served: Any, name: str,
                                                                how: str) -> None:
    data, _, _ = load(name)
    app, port = served
    app.seen.clear()
    got, closed = feed(port, pieces(data, how, random.Random(f"{SEED}{name}{how}")),
                       then_close=True)
    answered = statuses(got)
    assert app.seen == [], f"processed: {app.seen}"
    assert closed or answered, "neither refused nor closed"
    assert all(400 <= s < 600 for s in answered), answered
