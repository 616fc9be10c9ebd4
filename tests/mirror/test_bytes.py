"""The bytes server: ranges, headers, and no way out of the models dir."""

from __future__ import annotations

import hashlib
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from llmgw.mirror import PRESENT
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
    return mirror, model.url, data


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
    "http://127.0.0.1/m/v1/src.bin",
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
