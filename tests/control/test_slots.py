"""The slot poller's GET against a real loopback server: an answer no /slots could be
(a huge or malformed Content-Length, or an unbounded body) is refused before it is
buffered; a plain one is read whole."""

from __future__ import annotations

import asyncio

import pytest

from llmgw.control._slots import MAX_ANSWER_BYTES, _get


async def _serve_once(answer: bytes) -> tuple[asyncio.Server, int]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def get_from(answer: bytes) -> tuple[int, bytes]:
    async def run() -> tuple[int, bytes]:
        server, port = await _serve_once(answer)
        try:
            return await asyncio.wait_for(_get(f"http://127.0.0.1:{port}", "/slots", "k"), 10)
        finally:
            server.close()
    return asyncio.run(run())


@pytest.mark.parametrize("length", [b"99999999999999", b"-5", b"1_0", b"12abc"])
def test_a_content_length_no_slots_answer_has_is_refused(length: bytes) -> None:
    with pytest.raises(ValueError, match="not a length of at most"):
        get_from(b"HTTP/1.1 200 OK\r\nContent-Length: " + length + b"\r\n\r\n[]")


def test_an_answer_without_a_length_is_read_to_the_bound_and_no_further() -> None:
    with pytest.raises(ValueError, match=f"more than {MAX_ANSWER_BYTES} bytes"):
        get_from(b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * (MAX_ANSWER_BYTES + 10))


def test_negative_control_a_plain_answer_is_read_whole() -> None:
    assert get_from(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n[]") == (200, b"[]")
    assert get_from(b"HTTP/1.1 200 OK\r\n\r\n[{}]") == (200, b"[{}]")
