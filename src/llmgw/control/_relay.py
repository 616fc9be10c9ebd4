"""Relaying a replica's answer to the gateway's client: whole, or event by event, with the
model renamed at the byte level (`_wire`) and every other byte as the engine sent it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from llmgw._asgi import Receive, Send
from llmgw.control import _wire
from llmgw.control._upstream import Response, UpstreamError


def kept(headers: dict[bytes, bytes]) -> list[tuple[bytes, bytes]]:
    """The replica's headers the client gets."""
    return [(k, v) for k, v in headers.items() if k in (b"content-type", b"cache-control")]


def whole_answer(status: int, headers: dict[bytes, bytes], data: bytes, member: bytes
                 ) -> tuple[bytes, tuple[int, int] | None]:
    """A whole answer as the client gets it (a JSON 200's model renamed) and its usage."""
    if status != 200:
        return data, None
    if b"json" in headers.get(b"content-type", b""):
        data = _wire.rename_model(data, member)
    return data, _wire.usage(data)


async def relay_events(response: Response, send: Send, member: bytes, receive: Receive,
                       broke: Callable[[UpstreamError], bytes]) -> tuple[int, int] | None:
    """Relay an event stream event by event, each with the model renamed, bytes otherwise
    as the engine sent them. A client that leaves stops the generation: the gateway hangs
    up on the replica. A replica that breaks off ends the stream with an error event,
    broke's body (OpenAI's shape: its clients raise it), never with silence."""
    try:
        await send({"type": "http.response.start", "status": response.status,
                    "headers": kept(response.headers)})
    except BaseException:
        response.abort()  # its connection, and its replica's lease, are not kept
        raise
    buffer, usage = b"", None
    watcher = asyncio.ensure_future(disconnect(receive))
    def hang_up(_: object) -> None:
        response.abort()

    watcher.add_done_callback(hang_up)
    try:
        async for part in response.iter_raw():
            events, buffer = _wire.split_events(buffer + part)
            for event in events:
                usage = _wire.usage(event) or usage
                await send({"type": "http.response.body", "more_body": True,
                            "body": _wire.rename_model(event, member)})
    except UpstreamError as e:
        # The status is sent: what is left to say is an event, after any whole one.
        if not watcher.done():
            buffer = b"data: " + broke(e) + b"\n\n"
    finally:
        watcher.remove_done_callback(hang_up)
        watcher.cancel()
        response.release()
    await send({"type": "http.response.body", "body": buffer, "more_body": False})
    return usage


async def disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def respond(send: Send, status: int, body: bytes,
                   headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
