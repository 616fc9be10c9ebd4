"""A model's file size and KV geometry, read from its GGUF header over HTTP when the model
is added (one range request), and what is stored when it cannot be read."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from llmgw.control.catalog import HEADER_LIMIT, read_file_facts
from llmgw.model.ggufmeta import geometry
from tests import tiny_gguf

TINY = {"block_count": tiny_gguf.N_LAYER, "context_length": tiny_gguf.N_CTX,
        "embedding_length": tiny_gguf.N_EMBD, "head_count": tiny_gguf.N_HEAD,
        "head_count_kv": tiny_gguf.N_HEAD, "feed_forward_length": tiny_gguf.N_FF}


class _Ranges(BaseHTTPRequestHandler):
    """Serves one file, honouring `Range: bytes=0-N` as the mirror's bytes server does."""

    path_served: Path
    asked: list[str]

    def do_GET(self) -> None:
        data = self.path_served.read_bytes()
        asked = self.headers.get("Range", "")
        type(self).asked.append(asked)
        if asked.startswith("bytes=0-"):
            end = min(int(asked.removeprefix("bytes=0-")), len(data) - 1)
            self.send_response(206)
            self.send_header("Content-Range", f"bytes 0-{end}/{len(data)}")
            body = data[: end + 1]
        else:
            self.send_response(200)
            body = data
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def ranged(tiny_gguf: tuple[Path, str]) -> Iterator[tuple[str, list[str]]]:
    """Function: the tiny GGUF from a loopback server that answers ranges with 206, and
    the Range headers it was asked with."""
    asked: list[str] = []
    handler = type("H", (_Ranges,), {"path_served": tiny_gguf[0], "asked": asked})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/tiny.gguf", asked
    server.shutdown()


def test_the_header_reader_reads_the_tiny_models_shape(tiny_gguf: tuple[Path, str]) -> None:
    assert geometry(tiny_gguf[0]) == TINY


def test_a_range_answer_gives_the_whole_size_and_the_geometry(
        ranged: tuple[str, list[str]], tiny_gguf: tuple[Path, str]) -> None:
    url, asked = ranged
    size, found, why = read_file_facts(url)
    assert (size, found, why) == (tiny_gguf[0].stat().st_size, TINY, "")
    assert asked == [f"bytes=0-{HEADER_LIMIT - 1}"], "only the header's range is asked for"


def test_a_server_without_ranges_gives_the_size_from_its_length(
        served_gguf: tuple[str, str], tiny_gguf: tuple[Path, str]) -> None:
    size, found, why = read_file_facts(served_gguf[0])
    assert (size, found, why) == (tiny_gguf[0].stat().st_size, TINY, "")


def test_what_cannot_be_read_is_said_and_nothing_is_guessed(served_gguf: tuple[str, str]) -> None:
    base = served_gguf[0].rsplit("/", 1)[0]
    assert read_file_facts(f"{base}/missing.gguf")[:2] == (0, {})
    assert "answered 404" in read_file_facts(f"{base}/missing.gguf")[2]
    size, found, why = read_file_facts("hf:Org/Repo/model.gguf")
    assert (size, found) == (0, {}) and "not an http(s) URL" in why


def test_adding_a_model_stores_its_size_and_geometry(
        live_control_plane, served_gguf: tuple[str, str], tiny_gguf: tuple[Path, str]) -> None:
    admin = live_control_plane.admin
    body = {"name": "tiny", "source": served_gguf[0],
            "profiles": [{"name": "cpu", "engine": "llamacpp"}]}
    assert admin.post("/api/v1/models", json=body).status_code == 201
    stored = admin.get("/api/v1/models/tiny").json()
    assert stored["size_bytes"] == tiny_gguf[0].stat().st_size
    assert {k: v for k, v in stored["geometry"].items() if v} == TINY
    # Negative control: a source that is not there is added all the same, size unknown.
    gone = {**body, "name": "gone", "source": served_gguf[0].replace("tiny.gguf", "x.gguf")}
    assert admin.post("/api/v1/models", json=gone).status_code == 201
    assert admin.get("/api/v1/models/gone").json()["size_bytes"] == 0
