"""The gateway's pool holds at most a set number of connections to one replica: a request
beyond them waits for a connection in the gateway, never in a connection the engine has no
HTTP thread to serve (where the agent's health probe waited too, issue 11)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest

from llmgw.control._upstream import ConnectFailed, Timeouts, Upstream


@dataclass
class Replica:
    """A real HTTP/1.1 server on loopback that counts its open connections. Each answer's
    head goes out at once and its body when `release` is set (so a connection stays in use
    until then); it closes the connection after an answer if told to."""

    release: asyncio.Event = field(default_factory=asyncio.Event)
    close_after_answer: bool = False
    open_now: int = 0
    most_open: int = 0
    requests: int = 0
    endpoint: str = ""

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open_now += 1
        self.most_open = max(self.most_open, self.open_now)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                await reader.readexactly(length)
                self.requests += 1
                close = b"Connection: close\r\n" if self.close_after_answer else b""
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n" + close + b"\r\n")
                await self.release.wait()
                writer.write(b"ok")
                await writer.drain()
                if self.close_after_answer:
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            self.open_now -= 1
            writer.close()


@asynccontextmanager
async def replica(**options: bool) -> AsyncIterator[Replica]:
    r = Replica(**options)
    server = await asyncio.start_server(r.serve, "127.0.0.1", 0)
    r.endpoint = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield r
    finally:
        server.close()


async def post(upstream: Upstream, r: Replica) -> bytes:
    response = await upstream.post(r.endpoint, "/v1/chat/completions", b"{}", "key")
    return await response.read()


@pytest.mark.parametrize("limit,most", [(2, 2), (10, 6)], ids=["limit-2", "control-limit-10"])
def test_a_replica_gets_no_more_connections_than_the_limit_and_every_request_an_answer(
        limit: int, most: int) -> None:
    """The control: with room for all six, six connections open at once."""
    async def scenario() -> tuple[list[bytes], int]:
        async with replica() as r:
            upstream = Upstream(max_connections=limit)
            requests = [asyncio.ensure_future(post(upstream, r)) for _ in range(6)]
            while r.requests < min(limit, 6):
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)  # room for any request beyond the limit to arrive
            r.release.set()
            answers = await asyncio.wait_for(asyncio.gather(*requests), 10)
            await upstream.aclose()
            return answers, r.most_open

    answers, most_open = asyncio.run(scenario())
    assert answers == [b"ok"] * 6
    assert most_open == most


def test_a_request_that_waits_past_the_timeout_for_a_connection_is_never_sent() -> None:
    async def scenario() -> tuple[str, int]:
        async with replica() as r:
            upstream = Upstream(Timeouts(connect_s=1, read_s=0.3), max_connections=1)
            first = await upstream.post(r.endpoint, "/v1/chat/completions", b"{}", "key")
            with pytest.raises(ConnectFailed) as refused:
                await post(upstream, r)
            sent = r.requests
            r.release.set()
            await first.read()
            await upstream.aclose()
            return str(refused.value), sent

    message, sent = asyncio.run(scenario())
    assert sent == 1
    assert "all 1 connections" in message and "stayed busy for 0.3 s" in message
    assert "upstream_read_timeout_s" in message and "not sent" in message


def test_a_request_that_gives_up_waiting_takes_no_place_with_it() -> None:
    async def scenario() -> bytes:
        async with replica() as r:
            upstream = Upstream(Timeouts(connect_s=1, read_s=2), max_connections=1)
            first = asyncio.ensure_future(post(upstream, r))
            while r.requests < 1:
                await asyncio.sleep(0.01)
            waiting = asyncio.ensure_future(post(upstream, r))
            await asyncio.sleep(0.05)
            waiting.cancel()
            r.release.set()
            await first
            answer = await post(upstream, r)
            await upstream.aclose()
            return answer

    assert asyncio.run(scenario()) == b"ok"


def test_a_connection_the_replica_closes_frees_its_place() -> None:
    async def scenario() -> list[bytes]:
        async with replica(close_after_answer=True) as r:
            r.release.set()
            upstream = Upstream(Timeouts(connect_s=1, read_s=2), max_connections=1)
            answers = [await post(upstream, r) for _ in range(3)]
            await upstream.aclose()
            return answers

    assert asyncio.run(scenario()) == [b"ok"] * 3
