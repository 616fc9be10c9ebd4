"""A fake engine, a real HTTP server on loopback: llama-server's `/slots` (behind its key)
with as many slots as a test sets, busy while requests run, and answers a test can hold."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class FakeEngine:
    """slots: what /slots lists; hold: while clear, every POST waits (the engine is busy);
    bodies: each POST's body as it came; running: POSTs being answered now."""

    key: str
    slots: int
    hold: threading.Event = field(default_factory=threading.Event)
    bodies: list[bytes] = field(default_factory=list)
    running: int = 0
    port: int = 0
    polls: int = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def slots_answer(self) -> list[dict[str, Any]]:
        """Every slot holds a prompt (n_prompt_tokens), as a real engine's after its first
        requests; the first `running` are busy."""
        return [{"id": i, "n_ctx": 2048, "is_processing": i < self.running,
                 "n_prompt_tokens": 100} for i in range(self.slots)]


def _answer(engine: FakeEngine) -> type[BaseHTTPRequestHandler]:
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def _send(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.headers.get("Authorization") != f"Bearer {engine.key}":
                self._send(401, b'{"error":{"message":"Invalid API Key"}}')
                return
            engine.polls += 1
            self._send(200, json.dumps(engine.slots_answer()).encode())

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            with lock:
                engine.bodies.append(body)
                engine.running += 1
            try:
                engine.hold.wait(30)
            finally:
                with lock:
                    engine.running -= 1
            self._send(200, json.dumps({"choices": [{"message": {"content": "ok"}}],
                                        "model": "m", "usage": {}}).encode())

    return Handler


@contextmanager
def fake_engine(slots: int, key: str = "k", held: bool = False) -> Iterator[FakeEngine]:
    engine = FakeEngine(key, slots)
    if not held:
        engine.hold.set()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _answer(engine))
    server.daemon_threads = True
    engine.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield engine
    finally:
        engine.hold.set()
        server.shutdown()
        server.server_close()
