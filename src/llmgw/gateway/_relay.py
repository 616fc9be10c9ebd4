"""A replica's whole answer as the gateway's client gets it, with the model renamed at the
byte level (`_wire`) and every other byte as the engine sent it; the app's own answers."""

from __future__ import annotations

from llmgw.gateway import _wire
from llmgw.http1.asgi import Send


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


async def respond(send: Send, status: int, body: bytes,
                   headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
