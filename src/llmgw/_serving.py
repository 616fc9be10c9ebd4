"""uvicorn servers in a process that runs several listeners and handles its own signals."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from llmgw.config import parse_listen

# How long a closed TLS connection may wait for the peer's close_notify.
TLS_CLOSE_GRACE_S = 1.0


class _WritesGathered:
    """A transport that sends what is written in one turn of the event loop in one send().

    uvicorn writes an answer's head and its body in two send() calls, and on loopback each
    send() costs the sender as much as delivering the bytes (strace of the gateway under
    load: three sends per request, half of its time in system calls). Writes made back to
    back (an answer's head and body) now leave together at the end of the turn; a write
    after a wait (the next event of a stream) still leaves at once, in the turn it was made.
    Everything but writing and closing is the wrapped transport's.
    """

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(bytes(data))

    def writelines(self, lines: Any) -> None:
        for data in lines:
            self.write(data)

    def _flush(self) -> None:
        if self._pending:
            data = b"".join(self._pending)
            self._pending.clear()
            if not self._transport.is_closing():
                self._transport.write(data)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._pending))

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def close(self) -> None:
        self._flush()
        close_transport(self._transport, self._loop)

    def abort(self) -> None:
        self._pending.clear()
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def close_transport(transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
    """Close transport; on TLS, cut the socket once everything written has left, a
    TLS_CLOSE_GRACE_S after.

    A closed TLS connection waits for the peer's close_notify (30 s in uvloop), which an
    idle keep-alive client sends only when it next uses the connection: a draining server
    waited its whole bound for one (measured: an idle HTTPS client held the gateway's stop
    30 s)."""
    transport.close()
    if transport.get_extra_info("sslcontext") is not None:
        loop.call_later(TLS_CLOSE_GRACE_S, _abort_once_sent, transport, loop)


def _abort_once_sent(transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
    if transport.get_write_buffer_size():
        loop.call_later(TLS_CLOSE_GRACE_S, _abort_once_sent, transport, loop)
    else:
        transport.abort()


class _GatheringHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol writing through _WritesGathered."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_WritesGathered(transport, self.loop))  # type: ignore[arg-type]


class QuietServer(uvicorn.Server):
    """A uvicorn server that leaves signals to the process, which runs more than it."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def quiet_server(app: Any, listen: str, *, certfile: str = "", keyfile: str = ""
                 ) -> QuietServer:
    """app served on listen (HOST:PORT), uvicorn logging warnings only; HTTPS with
    certfile (the chain, leaf first) and keyfile. On stop, uvicorn waits for requests
    under way without a bound (the gateway, which bounds its drain, runs `_http1`)."""
    host, port = parse_listen(listen)
    # No access log: a line per request costs more than a request's own work.
    # No proxy headers: nothing here reads the client's address, and the middleware that
    # rewrites it is a layer on every request.
    return QuietServer(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                      access_log=False, http=_GatheringHttpToolsProtocol,
                                      proxy_headers=False, ssl_certfile=certfile or None,
                                      ssl_keyfile=keyfile or None))


def on_stop_signals(log: logging.Logger, stop: Callable[[], None]) -> None:
    """Call stop() once SIGTERM or SIGINT arrives, saying which; from inside the event loop."""
    loop = asyncio.get_running_loop()

    def received(sig: signal.Signals) -> None:
        log.info("received %s; shutting down", sig.name)
        stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, received, sig)


def run_service(main: Coroutine[Any, Any, None]) -> None:
    """Run a service's main coroutine to its end on uvloop (what uvicorn.run picks too; it
    halves the event loop's cost per request), or on asyncio's own loop without it."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main)
