"""The data plane's client against real loopback replicas. Its pool holds at most a set
number of connections to one replica: a request beyond them waits for a connection in the
gateway, never in a connection the engine has no HTTP thread to serve (where the agent's
health probe waited too, issue 11). An answer not taken pauses the read; one gathered whole
is capped; a stale pooled connection is sent on once more, and only then."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest

from llmgw.gateway._replica_conn import READ_AHEAD_BYTES
from llmgw.gateway._upstream import Call, ConnectFailed, Timeouts, Upstream, UpstreamError


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
    """The one connection is held by an answer not yet read (in whole, so the replica is
    not silent on it): the next request waits read_s for it, then gives up unsent."""
    async def scenario() -> tuple[str, int]:
        async with replica() as r:
            r.release.set()
            upstream = Upstream(Timeouts(connect_s=1, read_s=0.3), max_connections=1)
            first = await upstream.post(r.endpoint, "/v1/chat/completions", b"{}", "key")
            with pytest.raises(ConnectFailed) as refused:
                await post(upstream, r)
            sent = r.requests
            assert await first.read() == b"ok"
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


# --- one request's answer, read by callbacks (the gateway's Forwarder reads it so) ---

Script = Callable[[int], list[bytes] | None]


@asynccontextmanager
async def scripted(script: Script) -> AsyncIterator[tuple[str, list[int]]]:
    """A replica on loopback that reads each request and answers the nth (from 0, over all
    connections) with script(n)'s writes; None hangs up without a byte, a write of b""
    after what came before. Its endpoint, and
    the connection each request came on (a number per connection)."""
    came_on: list[int] = []
    connections = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        mine = connections
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length")), 0)
                await reader.readexactly(length)
                came_on.append(mine)
                writes = script(len(came_on) - 1)
                if writes is None:
                    return
                for data in writes:
                    if not data:
                        return
                    writer.write(data)
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", came_on
    finally:
        server.close()


def ok(body: bytes = b"ok") -> list[bytes]:
    return [b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)]


class Taker:
    """A Reader that takes what comes (or, take=False, leaves it untaken) and notes how the
    answer ended."""

    def __init__(self, take: bool = True) -> None:
        self.take_it = take
        self.got = b""
        self.error: UpstreamError | None = None
        self.ended = asyncio.get_running_loop().create_future()

    def answer_head(self, call: Call) -> None:
        pass

    def answer_data(self, call: Call) -> None:
        if self.take_it:
            self.got += call.take()
        if call.complete and not self.ended.done():
            self.got += call.take()
            self.ended.set_result(None)

    def answer_failed(self, call: Call, error: UpstreamError) -> None:
        self.error = error
        if not self.ended.done():
            self.ended.set_result(None)


@pytest.mark.parametrize("take", [False, True], ids=["untaken", "control-taken"])
def test_an_answer_not_taken_pauses_the_read_from_the_replica(take: bool) -> None:
    """A reader that leaves the body untaken (a stream's client that does not read) stops
    the connection reading once READ_AHEAD_BYTES wait; taking it resumes the read and the
    answer comes whole. The control takes as it comes: the read never pauses."""
    size = 8 * READ_AHEAD_BYTES
    body = bytes(range(256)) * (size // 256)

    async def scenario() -> tuple[bool, int, bytes]:
        async with scripted(lambda n: ok(body)) as (endpoint, _):
            upstream = Upstream()
            taker = Taker(take)
            call = upstream.call(taker, endpoint, "/v1/chat/completions", "key", b"{}")
            await asyncio.sleep(0.5)
            conn = call.conn
            assert conn is not None and conn.transport is not None
            reading, waiting = conn.transport.is_reading(), conn.buffered
            taker.take_it = True
            taker.answer_data(call)  # the client took what was written: on with the read
            await asyncio.wait_for(taker.ended, 10)
            call.end()
            await upstream.aclose()
            return reading, waiting, taker.got

    reading, waiting, got = asyncio.run(scenario())
    assert got == body
    if take:
        assert reading and waiting == 0
    else:
        assert not reading and READ_AHEAD_BYTES < waiting < 2 * READ_AHEAD_BYTES


@pytest.mark.parametrize("answer, refused", [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 5000\r\n\r\n" + b"x" * 5000, "Content-Length is 5000"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
     + b"400\r\n" + b"x" * 1024 + b"\r\n" + b"400\r\n" + b"x" * 1024 + b"\r\n0\r\n\r\n",
     "over 1500 bytes of it came"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 1500\r\n\r\n" + b"x" * 1500, ""),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5dc\r\n" + b"x" * 1500
     + b"\r\n0\r\n\r\n", ""),
], ids=["length-over", "chunked-over", "control-length-at-cap", "control-chunked-at-cap"])
def test_a_body_gathered_whole_is_refused_past_its_cap(answer: bytes, refused: str) -> None:
    """read(cap) takes an answer whole: one over the cap fails naming the cap (by its
    Content-Length, before any of it is held; chunked, once that much came). The controls
    are exactly at the cap, and read whole."""
    async def scenario() -> bytes | str:
        async with scripted(lambda n: [answer]) as (endpoint, _):
            upstream = Upstream()
            response = await upstream.post(endpoint, "/x", b"{}", "key")
            try:
                return await response.read(1500)
            except UpstreamError as e:
                return str(e)
            finally:
                await upstream.aclose()

    got = asyncio.run(scenario())
    if refused:
        assert isinstance(got, str) and refused in got and "the cap is 1500 bytes" in got
    else:
        assert got == b"x" * 1500


@pytest.mark.parametrize("second, sent, outcome", [
    (None, [1, 1, 2], "ok"),
    ("hang-up-again", [1, 1, 2], "closed the connection without an answer"),
    ("fresh", [1, 2], "closed the connection without an answer"),
    ("some-bytes", [1, 1], "without an answer: IncompleteReadError('1 bytes"),
], ids=["stale-resent", "resent-once-only", "control-fresh-not-resent",
        "control-bytes-came-not-resent"])
def test_a_request_on_a_pooled_connection_the_replica_closed_is_sent_once_more(
        second: str | None, sent: list[int], outcome: str) -> None:
    """The replica takes the second request on the pooled connection and hangs up without a
    byte (an engine that restarted, an idle connection dropped): the request never reached
    a live engine, so it goes once more, on a new connection. Not again when that one hangs
    up too; never when the connection was new (fresh: the pool is emptied first) or when
    some of an answer came (it may have run)."""
    def script(n: int) -> list[bytes] | None:
        if n == 0 or (n == 2 and second is None):
            return ok()
        if second == "some-bytes" and n == 1:
            return [ok()[0][:20], b""]
        return None

    async def scenario() -> tuple[str, list[int]]:
        async with scripted(script) as (endpoint, came_on):
            upstream = Upstream(Timeouts(connect_s=1, read_s=2))
            await (await upstream.post(endpoint, "/x", b"{}", "key")).read()
            if second == "fresh":
                await upstream.aclose()
            try:
                got = (await (await upstream.post(endpoint, "/x", b"{}", "key")).read()
                       ).decode()
            except UpstreamError as e:
                got = str(e)
            await upstream.aclose()
            return got, came_on

    got, came_on = asyncio.run(scenario())
    assert outcome in got and came_on == sent
