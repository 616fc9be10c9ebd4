"""uvicorn servers (its public API only) in a process that runs several listeners and handles
its own signals; the TLS close and the event loop every listener of ours shares."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Coroutine
from typing import Any

import uvicorn

from llmgw.config import parse_listen

# How long a closed TLS connection may wait for the peer's close_notify.
TLS_CLOSE_GRACE_S = 1.0


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


# The type quiet_server returns: uvicorn's own Server, through its public API only.
QuietServer = uvicorn.Server


def quiet_server(app: Any, listen: str, *, certfile: str = "", keyfile: str = "",
                 drain_s: float = 30.0) -> uvicorn.Server:
    """app served on listen (HOST:PORT), uvicorn logging warnings only; HTTPS with
    certfile (the chain, leaf first) and keyfile. On stop, requests under way get drain_s
    (uvicorn's timeout_graceful_shutdown), then are cut: an idle HTTPS keep-alive client,
    whose close_notify uvloop would wait 30 s for, holds the stop no longer than that.

    Signals: while it serves in the main thread, uvicorn catches SIGINT and SIGTERM and,
    once it has stopped, raises them again (its cooperative handling, uvicorn >= 0.29).
    The process's own handlers (on_stop_signals) hear them meanwhile too: the event loop
    reads every signal from its wakeup file, whichever Python handler is set."""
    host, port = parse_listen(listen)
    # No access log: a line per request costs more than a request's own work.
    # No proxy headers: nothing here reads the client's address, and the middleware that
    # rewrites it is a layer on every request.
    # The ignore: uvicorn annotates timeout_graceful_shutdown int, but hands it to
    # asyncio.timeout, which takes any seconds.
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            proxy_headers=False, ssl_certfile=certfile or None,
                            ssl_keyfile=keyfile or None,
                            timeout_graceful_shutdown=drain_s)  # type: ignore[arg-type]
    return uvicorn.Server(config)


def on_stop_signals(log: logging.Logger, stop: Callable[[], None]) -> None:
    """Call stop() when SIGTERM or SIGINT arrives, saying which the first time; from inside
    the event loop. (uvicorn raises a signal it caught once more after its stop.)"""
    loop = asyncio.get_running_loop()
    said: set[signal.Signals] = set()

    def received(sig: signal.Signals) -> None:
        if not said:
            log.info("received %s; shutting down", sig.name)
        said.add(sig)
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
