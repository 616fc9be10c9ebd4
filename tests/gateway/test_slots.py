"""The slot poller's GET of /slots against a real loopback server, through the data plane's
client (no socket of its own): an answer no /slots could be (a huge or malformed
Content-Length, or an unbounded body) is refused before it is buffered; a plain one is read
whole, chunked or not; polls ride one pooled connection."""

from __future__ import annotations

import asyncio

import pytest

from llmgw.gateway._slots import MAX_ANSWER_BYTES, SlotPoller, get_slots
from llmgw.gateway._upstream import Upstream, UpstreamError
from llmgw.gateway.balancer import Balancer


async def _serve(answer: bytes, connections: list[int] | None = None) -> asyncio.Server:
    """Answers every GET on a connection with answer (and closes the connection after one
    with neither a length nor chunks: its end is the close); each connection noted in
    connections."""
    framed = b"content-length" in answer.lower() or b"chunked" in answer.lower()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if connections is not None:
            connections.append(len(connections))
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                writer.write(answer)
                await writer.drain()
                if not framed:
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def get_from(answer: bytes) -> tuple[int, bytes]:
    async def run() -> tuple[int, bytes]:
        server = await _serve(answer)
        upstream = Upstream()
        try:
            port = server.sockets[0].getsockname()[1]
            return await asyncio.wait_for(get_slots(upstream, f"http://127.0.0.1:{port}", "k"),
                                          10)
        finally:
            await upstream.aclose()
            server.close()
    return asyncio.run(run())


def test_a_content_length_over_the_bound_is_refused_before_the_body_is_held() -> None:
    with pytest.raises(UpstreamError, match=f"the cap is {MAX_ANSWER_BYTES} bytes"):
        get_from(b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999999\r\n\r\n[]")


@pytest.mark.parametrize("length", [b"-5", b"1_0", b"12abc"])
def test_a_content_length_that_is_no_length_is_refused(length: bytes) -> None:
    with pytest.raises(UpstreamError, match="not HTTP/1.1"):
        get_from(b"HTTP/1.1 200 OK\r\nContent-Length: " + length + b"\r\n\r\n[]")


@pytest.mark.parametrize("framing", [b"", b"Transfer-Encoding: chunked\r\n"],
                         ids=["to-the-close", "chunked"])
def test_an_answer_without_a_length_is_read_to_the_bound_and_no_further(framing: bytes
                                                                         ) -> None:
    big = b"x" * (MAX_ANSWER_BYTES + 10)
    body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(big), big) if framing else big
    with pytest.raises(UpstreamError, match=f"over {MAX_ANSWER_BYTES} bytes of it came"):
        get_from(b"HTTP/1.1 200 OK\r\n" + framing + b"\r\n" + body)


def test_negative_control_a_plain_answer_is_read_whole_chunked_or_not() -> None:
    """llama-server may answer /slots chunked: the hand-written GET this replaced could
    not read that."""
    assert get_from(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n[]") == (200, b"[]")
    assert get_from(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n[{}]") == (200, b"[{}]")
    assert get_from(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                    b"2\r\n[{\r\n1\r\n}\r\n1\r\n]\r\n0\r\n\r\n") == (200, b"[{}]")


SLOTS = (b'[{"id":0,"is_processing":true,"n_prompt_tokens":7},'
         b'{"id":1,"is_processing":false}]')


@pytest.mark.parametrize("drop_pool", [False, True], ids=["pooled", "control-pool-emptied"])
def test_the_poller_reads_slots_through_the_data_plane_client_on_its_pooled_connection(
        drop_pool: bool) -> None:
    """Two polls of a replica answering chunked: the balancer learns its slots, and both
    polls ride one connection of the client the poller was given. The control empties
    that client's pool between the polls: the second opens a connection of its own."""
    answer = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
              % (len(SLOTS), SLOTS))

    async def run() -> tuple[list[int], int | None]:
        connections: list[int] = []
        server = await _serve(answer, connections)
        upstream = Upstream()
        balancer = Balancer("balanced")
        endpoint = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        replica = {"id": "r1", "model": "m", "node": "n", "profile": "cpu", "state": "ready",
                   "endpoint": endpoint, "api_key": "k"}
        poller = SlotPoller(balancer, lambda: [replica], upstream)  # type: ignore[list-item]
        try:
            await poller.poll_once()
            if drop_pool:
                await upstream.aclose()
            await poller.poll_once()
        finally:
            await upstream.aclose()
            server.close()
        return connections, balancer.loads["r1"].slots

    connections, slots = asyncio.run(run())
    assert slots == 2
    assert len(connections) == (2 if drop_pool else 1)
