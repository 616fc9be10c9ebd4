"""What the HTTP core itself costs a request, with no socket and no other process. Run on
demand:

    python bench/http1_core.py [--requests 20000] [--repeats 30]

One connection of `llmgw.http1.server.Http1Server` is fed a chat-completion POST at a time (as
one read), each answered whole by a fast handler (`fast=`, the gateway's hot path: the
body taken, the answer written at once): the parser, the connection's bookkeeping and
the answer's head, nothing else. Its transport only counts the bytes written. On a
shared machine noise only adds, so the best of the repeats is what the code costs; run
two versions of the code alternately (PYTHONPATH=OTHER/src) to compare them. The last
line: `N.NN us a request (best of R repeats of N)`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

# Appended: a PYTHONPATH given (another version of the code) comes first.
sys.path.append(str(Path(__file__).resolve().parents[1] / "src"))

from llmgw.http1.server import Cycle, Http1Server  # noqa: E402

BODY = b'{"model":"tiny","messages":[{"role":"user","content":"hi"}],"max_tokens":8}'
REQUEST = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8080\r\n"
           b"User-Agent: bench\r\nAuthorization: Bearer sk-0123456789\r\n"
           b"Content-Type: application/json\r\nAccept: */*\r\n"
           b"Content-Length: %d\r\n\r\n" % len(BODY)) + BODY
ANSWER = b'{"choices":[]}'


class CountingTransport:
    """What the connection writes to, counted; never paused, never closing."""

    def __init__(self) -> None:
        self.written = 0

    def write(self, data: bytes) -> None:
        self.written += len(data)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 40000), "sockname": ("127.0.0.1", 8080)}.get(name)

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0


def answer_at_once(cycle: Cycle) -> bool:
    cycle.body_bytes()
    cycle.answer(200, [(b"content-type", b"application/json")], ANSWER)
    return True


async def never_called(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("the fast handler answers every request")


def one_run(requests: int) -> float:
    """Microseconds a request over requests fed to one new connection."""
    loop = asyncio.new_event_loop()
    try:
        server = Http1Server(never_called, fast=answer_at_once)
        server.loop = loop
        conn: Any = server.protocol_factory()()
        transport = CountingTransport()
        conn.connection_made(transport)
        start = time.perf_counter()
        for _ in range(requests):
            conn.data_received(REQUEST)
        took = time.perf_counter() - start
    finally:
        loop.close()
    if transport.written < requests * len(ANSWER):
        sys.exit(f"only {transport.written} bytes were answered to {requests} requests")
    return took / requests * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    best = min(one_run(args.requests) for _ in range(args.repeats))
    print(f"{best:.2f} us a request (best of {args.repeats} repeats of {args.requests})")


if __name__ == "__main__":
    main()
