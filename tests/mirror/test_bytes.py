"""The bytes server: ranges, headers, no way out of the models dir, and hostile clients."""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from llmgw.host.waiting import Probe, wait_until
from llmgw.http1.limits import Limits
from llmgw.mirror import PRESENT
from llmgw.mirror._bytes import BytesServer
from llmgw.mirror._downloads import Manager
from tests.hosts import free_port
from tests.mirror.conftest import MirrorProcess

SECRET = b"the bytes of a file outside the models dir " * 50


def _serve(tmp_path: Path) -> tuple[MirrorProcess, str, bytes]:
    (tmp_path / "secret.txt").write_bytes(SECRET)
    data = os.urandom(4000)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    mirror = MirrorProcess(tmp_path / "models", free_port(), free_port()).start()
    with mirror.client() as api:
        api.upload(src, model="m", version="v1")
    model = mirror.wait_for("m", "v1", PRESENT)
    return mirror, model["url"], data


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[MirrorProcess, str, bytes]]:
    """Module: a mirror holding m/v1/src.bin (4000 random bytes), a secret file beside its
    dir; for tests that only read."""
    mirror, url, data = _serve(tmp_path_factory.mktemp("served"))
    yield mirror, url, data
    mirror.stop(signal.SIGKILL)


@pytest.fixture
def served_rw(tmp_path: Path) -> Iterator[tuple[MirrorProcess, str, bytes]]:
    """Function: the same, for tests that change the models dir."""
    mirror, url, data = _serve(tmp_path)
    yield mirror, url, data
    mirror.stop(signal.SIGKILL)


def raw_get(port: int, target: str, method: str = "GET") -> tuple[int, bytes]:
    """Send target as-is (no client normalises it); the status and the whole answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(f"{method} {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    return int(answer.split(b" ", 2)[1]), answer


def test_a_range_returns_exactly_those_bytes(served):
    """`curl -r 100-199`: 206, Content-Range, exactly bytes 100..199; without Range, all (200)."""
    _, url, data = served
    part = httpx.get(url, headers={"Range": "bytes=100-199"})
    assert part.status_code == 206
    assert part.headers["content-range"] == f"bytes 100-199/{len(data)}"
    assert part.content == data[100:200]
    whole = httpx.get(url)
    assert whole.status_code == 200 and whole.content == data


def test_suffix_and_open_ranges(served):
    """bytes=-10 is the last ten bytes; bytes=3990- runs to the end."""
    _, url, data = served
    assert httpx.get(url, headers={"Range": "bytes=-10"}).content == data[-10:]
    assert httpx.get(url, headers={"Range": "bytes=3990-"}).content == data[3990:]


def test_a_range_past_the_end_is_416(served):
    """A range starting past the end: 416 with Content-Range bytes */size."""
    _, url, data = served
    answer = httpx.get(url, headers={"Range": f"bytes={len(data)}-"})
    assert answer.status_code == 416
    assert answer.headers["content-range"] == f"bytes */{len(data)}"


def test_head_gives_length_etag_and_last_modified_without_a_body(served):
    """HEAD: Content-Length, ETag = the sha256, Last-Modified, Accept-Ranges; no body."""
    _mirror, url, data = served
    answer = httpx.head(url)
    assert answer.status_code == 200 and answer.content == b""
    assert answer.headers["content-length"] == str(len(data))
    assert answer.headers["etag"] == f'"{hashlib.sha256(data).hexdigest()}"'
    assert answer.headers["accept-ranges"] == "bytes" and answer.headers["last-modified"]


def test_only_get_and_head(served):
    _mirror, url, _ = served
    assert httpx.post(url).status_code == 405


@pytest.mark.parametrize("target", [
    "/../secret.txt",
    "/m/../../secret.txt",
    "/m/v1/../../../secret.txt",
    "/m/v1/%2e%2e/%2e%2e/%2e%2e/secret.txt",
    "/%2e%2e/secret.txt",
    "/m/v1/..%2f..%2f..%2fsecret.txt",
    "/m/v1/%2E%2E%2F%2E%2E%2F%2E%2E%2Fsecret.txt",
    "/m/v1/%252e%252e%252f%252e%252e%252fsecret.txt",
    "/m/v1/..%5c..%5c..%5csecret.txt",
    "//secret.txt",
    "/m/v1/src.bin%00",
    "/m/v1/.llmgw-mirror.json",
    "/m/v1/.src.bin.partial",
    "http://127.0.0.1/m/../../secret.txt",
    "/m/v1/src.bin/../../../secret.txt",
    "/%c0%ae%c0%ae/secret.txt",
])
def test_path_escapes_get_400_or_404_and_never_other_bytes(served, target):
    """Traversal, encoded traversal, hidden files and absolute-form targets: 400 or 404,
    and the answer never holds the secret's bytes."""
    mirror, _, _ = served
    status, answer = raw_get(mirror.bytes_port, target)
    assert status in (400, 404), answer[:300]
    assert SECRET[:40] not in answer


def test_an_absolute_form_target_is_served_as_its_path(served):
    """RFC 9112 3.2.2: a server must accept the absolute-form; the HTTP core takes its
    path, so it is the same file (and the traversal checks above hold for it too)."""
    mirror, _, data = served
    status, answer = raw_get(mirror.bytes_port, "http://127.0.0.1/m/v1/src.bin")
    assert status == 200 and answer.endswith(data)


def test_the_raw_request_helper_does_serve_the_file(served):
    """Negative control for the traversal test: the same helper gets the real file."""
    mirror, _, data = served
    status, answer = raw_get(mirror.bytes_port, "/m/v1/src.bin")
    assert status == 200 and answer.endswith(data)


def test_a_symlink_out_of_the_models_dir_is_not_followed(served_rw, tmp_path):
    """A present file replaced by a symlink to a file outside: 404, not the outside bytes."""
    mirror, url, _ = served_rw
    final = mirror.dir / "m" / "v1" / "src.bin"
    final.unlink()
    final.symlink_to(tmp_path / "secret.txt")
    answer = httpx.get(url)
    assert answer.status_code == 404 and SECRET[:40] not in answer.content


def test_a_version_dir_symlinked_outside_is_not_followed(served_rw, tmp_path):
    """A version folder replaced by a symlink to a folder outside: 404."""
    mirror, url, _data = served_rw
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "src.bin").write_bytes(SECRET)
    vdir = mirror.dir / "m" / "v1"
    vdir.rename(tmp_path / "moved")
    vdir.symlink_to(outside)
    answer = httpx.get(url)
    assert answer.status_code == 404 and SECRET[:40] not in answer.content


def test_keep_alive_serves_several_requests_on_one_connection(served):
    """A client reusing its connection gets every answer right."""
    _, url, data = served
    with httpx.Client() as client:
        for start in (0, 1000, 2000):
            got = client.get(url, headers={"Range": f"bytes={start}-{start + 9}"})
            assert got.content == data[start:start + 10]


# --- hostile clients ---

def exchange(port: int, data: bytes, within_s: float = 5.0) -> bytes:
    """Send data as-is; everything the server sent until it closed (or within_s passed)."""
    with socket.create_connection(("127.0.0.1", port), timeout=within_s) as s:
        s.sendall(data)
        answer = b""
        try:
            while chunk := s.recv(65536):
                answer += chunk
        except (TimeoutError, ConnectionError):
            pass
    return answer


def statuses(answer: bytes) -> list[int]:
    """The status of each answer in a run of them (file bytes between are skipped)."""
    return [int(m[1]) for m in re.finditer(rb"HTTP/1\.1 (\d{3}) ", answer)]


def test_two_content_lengths_are_400_and_the_request_hidden_behind_is_not_answered(served):
    """Content-Length N then 0: 400 and close; the GET hidden in the N bytes is never
    answered as a request of its own."""
    mirror, _, _ = served
    hidden = b"GET /m/v1/src.bin HTTP/1.1\r\nHost: x\r\nRange: bytes=0-9\r\n\r\n"
    answer = exchange(mirror.bytes_port, (
        f"GET /m/v1/src.bin HTTP/1.1\r\nHost: x\r\nContent-Length: {len(hidden)}\r\n"
        "Content-Length: 0\r\n\r\n").encode() + hidden)
    assert statuses(answer) == [400], answer[:300]


def test_negative_control_the_same_pipelined_pair_without_the_second_length(served):
    """The two requests sent plainly, one after the other: both answered (200, then 206)."""
    mirror, _, _ = served
    answer = exchange(mirror.bytes_port,
                      b"GET /m/v1/src.bin HTTP/1.1\r\nHost: x\r\n\r\n"
                      b"GET /m/v1/src.bin HTTP/1.1\r\nHost: x\r\nRange: bytes=0-9\r\n"
                      b"Connection: close\r\n\r\n")
    assert statuses(answer) == [200, 206], answer[:300]


@pytest.mark.parametrize("spec", [f"bytes={'9' * 5000}-", f"bytes=0-{'9' * 5000}",
                                  f"bytes=-{'9' * 5000}"])
def test_a_range_with_thousands_of_digits_is_refused_without_a_traceback(served, spec):
    """Numbers past int()'s digit limit: 416 (or 400), and the mirror logs no traceback."""
    mirror, _, _ = served
    answer = exchange(mirror.bytes_port, (f"GET /m/v1/src.bin HTTP/1.1\r\nHost: x\r\n"
                                          f"Range: {spec}\r\nConnection: close\r\n\r\n").encode())
    assert statuses(answer) in ([416], [400]), answer[:300]
    assert "Traceback" not in mirror.log(), mirror.log()[-3000:]


BIG = 32 * 1024 * 1024
MARGIN_S = 4.0  # past a deadline, on a shared machine


@pytest.fixture(scope="module")
def big_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Module: a models dir holding big/v1/big.bin (32 MiB, present and checked), and the
    folder its source came from (an import dir)."""
    base = tmp_path_factory.mktemp("big")
    src = base / "src"
    src.mkdir()
    (src / "big.bin").write_bytes(os.urandom(1 << 20) * (BIG >> 20))
    manager = Manager(base / "models", "http://127.0.0.1", import_dirs=(src,))
    manager.start()
    try:
        manager.fetch(f"file://{src / 'big.bin'}", "big", "v1", None)
        wait_until("big/v1 to be present", lambda: Probe(
            (view := manager.view("big", "v1")) is not None
            and view["status"]["state"] == PRESENT, repr(manager.view("big", "v1"))),
            timeout_s=60, interval_s=0.05)
    finally:
        manager.stop()
    return base / "models", src


def _limits(write_s: float) -> dict:
    """BytesServer's limits with this write deadline (the core's Limits.write_timeout_s)."""
    return {"limits": Limits(write_timeout_s=write_s)}


@contextmanager
def bytes_server(models: Path, src: Path, **deadlines: float) -> Iterator[tuple[object, int]]:
    """The mirror's bytes server over models, in this process on a loop of its own, with
    these deadlines, for the length of the block; it and its port."""
    manager = Manager(models, "http://127.0.0.1", import_dirs=(src,))
    manager.start()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = BytesServer(manager, "", **_limits(**deadlines))
    port = free_port()
    try:
        asyncio.run_coroutine_threadsafe(server.start("127.0.0.1", port), loop).result(10)
        yield server, port
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
        manager.stop()


def held(server: object) -> int:
    """Connections the bytes server holds open now."""
    return server.connections  # type: ignore[attr-defined,no-any-return]


def stop_reading(port: int, gets: int) -> socket.socket:
    """A client with a 4 KiB receive buffer that sends gets pipelined GETs of the big
    file, then reads nothing."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"GET /big/v1/big.bin HTTP/1.1\r\nHost: x\r\n\r\n" * gets)
    return sock


def read_all(sock: socket.socket, cap: int) -> tuple[int, bool]:
    """Read until the server closes or cap bytes came: how many, and whether it closed."""
    sock.settimeout(MARGIN_S)
    got = 0
    try:
        while got < cap:
            chunk = sock.recv(1 << 20)
            if not chunk:
                return got, True
            got += len(chunk)
    except ConnectionError:
        return got, True
    except TimeoutError:
        pass
    return got, False


def test_a_client_that_stops_reading_is_let_go_by_the_write_deadline(big_models):
    """36 pipelined GETs of a 32 MiB file into a 4 KiB receive buffer, then no reads: the
    connection is closed by the write deadline (within its margin) and the server holds
    nothing for it; what reaches the client after is what the kernel had queued, far less
    than one file."""
    with bytes_server(*big_models, write_s=1.0) as (server, port):
        sock = stop_reading(port, 36)
        try:
            time.sleep(1.0 + MARGIN_S)
            assert held(server) == 0, "the bytes server still holds the stalled client"
            got, closed = read_all(sock, 2 * BIG)
        finally:
            sock.close()
    assert closed and got < BIG, f"{got} bytes came, {'then EOF' if closed else 'and more'}"


def test_negative_control_a_raised_write_deadline_still_holds_the_stalled_client(big_models):
    """The same stalled client with the deadline raised: held when the test looks."""
    with bytes_server(*big_models, write_s=60.0) as (server, port):
        sock = stop_reading(port, 36)
        try:
            time.sleep(1.0 + MARGIN_S)
            assert held(server) == 1
        finally:
            sock.close()
