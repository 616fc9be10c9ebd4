"""A node's weights cache: a model the node served before loads from its own disk (the
file kept under its sha256), and the mirror is asked only for what the node lacks."""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from llmgw import httpclient
from llmgw.agent.replicas import _weights


class _Counting(SimpleHTTPRequestHandler):
    gets: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.gets.append(self.path)
        super().do_GET()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def mirror(tiny_gguf: tuple[Path, str]) -> Iterator[tuple[str, list[str]]]:
    """Function: the tiny GGUF served on loopback, and the paths each GET asked for."""
    path, _ = tiny_gguf
    gets: list[str] = []
    handler = type("Handler", (_Counting,), {"gets": gets})
    server = ThreadingHTTPServer(("127.0.0.1", 0),
                                 functools.partial(handler, directory=str(path.parent)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/{path.name}", gets
    server.shutdown()
    server.server_close()


def test_a_model_served_before_loads_from_the_nodes_own_disk(
        mirror: tuple[str, list[str]], tiny_gguf: tuple[Path, str], tmp_path: Path) -> None:
    """The second load of a model (a new replica, after the first was removed as idle) asks
    the mirror nothing; control: with the node's copy gone, it asks again."""
    source, gets = mirror
    digest = tiny_gguf[1]
    with httpclient.client(timeout=10) as http:
        first = _weights.fetch(http, tmp_path, source, digest, "tiny")
        again = _weights.fetch(http, tmp_path, source, digest, "tiny")
        assert again == first and len(gets) == 1
        assert first.read_bytes() == tiny_gguf[0].read_bytes()
        first.unlink()
        _weights.fetch(http, tmp_path, source, digest, "tiny")
    assert len(gets) == 2
