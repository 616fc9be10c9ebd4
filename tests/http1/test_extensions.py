"""What the HTTP core offers servers built on it: connections accepted by the caller
(protocol_factory), the TLS extension with the client certificate in the scope, drop()
by that certificate, and the ASGI zero-copy send (sendfile) on asyncio, uvloop and TLS."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import struct
import time
from pathlib import Path
from typing import Any

import pytest

from llmgw.host import pki
from llmgw.http1.server import SENDFILE_CHUNK_BYTES
from tests.http1.servers import LoopKind, accepting, in_loop, running
from tests.http1.wire import Client, get


async def tls_echo(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answers the scope's TLS extension as JSON (null on plain HTTP)."""
    if scope["type"] != "http":
        return
    body = json.dumps(scope["extensions"].get("tls")).encode()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


class Cluster:
    """A CA, a server certificate for 127.0.0.1 and client certificates by name."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.ca = pki.create_ca()
        self.bundle, _ = self.ca.write(directory, "ca")
        self.cert, self.key = pki.issue_server(self.ca, ["127.0.0.1"]).write(directory, "srv")

    def server_context(self) -> ssl.SSLContext:
        """Verifies a client certificate when one is offered, as the agent API does."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.cert, self.key)
        context.load_verify_locations(self.bundle)
        context.verify_mode = ssl.CERT_OPTIONAL
        return context

    def client_context(self, name: str = "") -> tuple[ssl.SSLContext, str]:
        """A client's context, with a certificate for name if given; its serial."""
        context = ssl.create_default_context(cafile=str(self.bundle))
        if not name:
            return context, ""
        pair = pki.issue_client(self.ca, name)
        cert, key = pair.write(self.directory, name)
        context.load_cert_chain(cert, key)
        return context, pki.serial_hex(pair.cert)


@pytest.fixture
def cluster(tmp_path: Path) -> Cluster:
    """A fresh CA and server certificate in tmp_path (function scope)."""
    return Cluster(tmp_path)


# A serial whose first nibble is 0 (one random serial in eight): getpeercert() writes it
# "07526F…", the store "7526F…" (pki.serial_hex). Seen failing in CI before the core
# carried the integer's spelling; the other serial is the control.
SERIALS = {"leading zero": 0x07526F8FACA0CE6CD4577E9BAAA17C88DA4361E4,
           "no leading zero": 0x7526F8FACA0CE6CD4577E9BAAA17C88DA4361E4}


@pytest.mark.parametrize("serial_number", SERIALS.values(), ids=SERIALS.keys())
def test_an_accepted_connection_carries_the_verified_client_certificate(
        cluster: Cluster, serial_number: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Handed over with protocol_factory(): the scope's tls extension names the client
    certificate (commonName, serial as pki.serial_hex writes it, RFC 4514 subject) and
    TLS 1.3; the negative control, a client with no certificate, has none in its scope."""
    monkeypatch.setattr(pki.x509, "random_serial_number", lambda: serial_number)
    node, serial = cluster.client_context("node-1")
    assert serial == format(serial_number, "X")
    anonymous, _ = cluster.client_context()
    with accepting(tls_echo, cluster.server_context()) as (_, port):
        with Client(port, context=node) as client:
            client.send(get("/"))
            tls = json.loads(client.answer().body)
        with Client(port, context=anonymous) as client:
            client.send(get("/"))
            none = json.loads(client.answer().body)
    assert tls["client_cert_common_name"] == "node-1"
    assert tls["client_cert_serial"] == serial and serial
    assert tls["client_cert_name"] == "CN=node-1,O=llmgw"
    assert tls["tls_version"] == 0x0304
    assert tls["client_cert_chain"][0].startswith("-----BEGIN CERTIFICATE-----")
    assert none["client_cert_common_name"] == "" and none["client_cert_serial"] == ""
    assert none["client_cert_chain"] == [] and none["client_cert_name"] is None


def test_a_plain_connection_has_no_tls_extension_but_the_zero_copy_one() -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            body = json.dumps(sorted(scope["extensions"])).encode()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": body})

    with running(app) as (_, _, port), Client(port) as client:
        client.send(get("/"))
        assert json.loads(client.answer().body) == ["http.response.zerocopysend"]


def test_drop_cuts_the_connections_whose_certificate_it_names_and_no_other(
        cluster: Cluster) -> None:
    """Two nodes on keep-alive connections: drop() naming node-1 cuts its connection at
    once; node-2's goes on being answered (the negative control)."""
    one, _ = cluster.client_context("node-1")
    two, _ = cluster.client_context("node-2")
    with accepting(tls_echo, cluster.server_context()) as (server, port), \
            Client(port, context=one) as first, Client(port, context=two) as second:
        for client in (first, second):
            client.send(get("/"))
            assert client.answer().status == 200
        dropped = in_loop(server, lambda: server.drop(
            lambda tls: tls is not None and tls["client_cert_common_name"] == "node-1"))
        assert dropped == 1
        assert first.closed(), "the dropped node's connection stayed open"
        second.send(get("/again"))
        assert json.loads(second.answer().body)["client_cert_common_name"] == "node-2"


def test_a_server_that_accepts_nothing_itself_drains_the_connections_handed_to_it(
        cluster: Cluster) -> None:
    """An idle accepted connection is closed by the drain, which then ends."""
    node, _ = cluster.client_context("node-1")
    with accepting(tls_echo, cluster.server_context()) as (server, port), \
            Client(port, context=node) as client:
        client.send(get("/"))
        assert client.answer().status == 200
        assert len(server.connections) == 1
        server.should_exit = True
        assert client.closed(), "the drain left an accepted connection open"


def file_app(path: Path, offset: int, count: int | None, length: bool, more: bool) -> Any:
    """Answers with count bytes of path from offset by zero-copy send (a content-length
    header when length; a last body "!" after it when more)."""
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        headers = []
        if length:
            size = (count if count is not None else path.stat().st_size - offset) + more
            headers.append((b"content-length", b"%d" % size))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        with path.open("rb") as f:
            message = {"type": "http.response.zerocopysend", "file": f, "offset": offset,
                       "more_body": more}
            if count is not None:
                message["count"] = count
            await send(message)
        if more:
            await send({"type": "http.response.body", "body": b"!"})

    return app


@pytest.fixture
def big_file(tmp_path: Path) -> tuple[Path, bytes]:
    """A file of 2.5 sendfile chunks of varied bytes."""
    data = bytes(range(256)) * (SENDFILE_CHUNK_BYTES * 5 // 2 // 256)
    path = tmp_path / "weights.bin"
    path.write_bytes(data)
    return path, data


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize(("length", "more"), [(False, False), (True, False), (False, True)])
def test_a_zero_copy_send_answers_the_files_bytes(
        big_file: tuple[Path, bytes], loop: LoopKind, length: bool, more: bool) -> None:
    """sendfile on asyncio's loop, reads on uvloop's: the bytes asked for, whole, framed
    by the app's content-length, one the server sets, or chunks; then HEAD has none."""
    path, data = big_file
    offset, count = 1000, len(data) - 5000
    with running(file_app(path, offset, count, length, more), loop) as (_, _, port), \
            Client(port) as client:
        client.send(get("/"))
        got = client.answer()
        client.send(get("/", method="HEAD"))
        head = client.answer(head_only=True)
    assert got.status == 200
    assert got.body == data[offset:offset + count] + (b"!" if more else b"")
    assert ("transfer-encoding" in got.headers) == (more and not length)
    assert head.status == 200 and not client.buffer


def test_a_zero_copy_send_over_tls_reads_the_file_without_a_count(
        cluster: Cluster, big_file: tuple[Path, bytes]) -> None:
    """TLS has no sendfile: the same bytes by reads; no count means to the file's end."""
    path, data = big_file
    context, _ = cluster.client_context()
    with running(file_app(path, 7, None, False, False), certfile=str(cluster.cert),
                 keyfile=str(cluster.key)) as (_, _, port), \
            Client(port, context=context) as client:
        client.send(get("/"))
        assert client.answer().body == data[7:]


def test_a_pipelined_request_whose_connection_is_gone_by_its_turn_is_never_started(
        ) -> None:
    """Two pipelined requests, then a reset while the first is under way: the second's
    answer can no longer be sent, so the app never sees it; a request on another
    connection (the control) is served."""
    seen: list[str] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            seen.append(scope["path"])
            await asyncio.sleep(0.3 if scope["path"] == "/first" else 0)
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

    with running(app) as (_, _, port):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(get("/first") + get("/second"))
        time.sleep(0.1)  # both heads are in
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # a reset: nothing can be answered any more
        with Client(port) as control:
            time.sleep(0.6)
            control.send(get("/control"))
            assert control.answer().status == 200
    assert seen == ["/first", "/control"]
