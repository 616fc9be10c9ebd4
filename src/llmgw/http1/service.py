"""Running a service process: its event loop, its stop signals and its listeners' start."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from llmgw.errors import Error


class ListenError(Error):
    """A service cannot listen on its address (taken, or not this machine's)."""


class Listener(Protocol):
    """A server that listens once serve() runs (`server.Http1Server`)."""

    listen: str

    async def start(self) -> asyncio.Task[None]: ...


def on_stop_signals(log: logging.Logger, stop: Callable[[], None]) -> None:
    """Call stop() when SIGTERM or SIGINT arrives, saying which the first time; from inside
    the event loop."""
    loop = asyncio.get_running_loop()
    said: set[signal.Signals] = set()

    def received(sig: signal.Signals) -> None:
        if not said:
            log.info("received %s; shutting down", sig.name)
        said.add(sig)
        stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, received, sig)


async def listening(server: Listener, what: str) -> asyncio.Task[None]:
    """server.serve() in a task, once it listens; ListenError (naming what it serves) when
    it cannot."""
    try:
        return await server.start()
    except OSError as e:
        raise ListenError(f"cannot listen on {server.listen} for {what}: {e}; is "
                          "another program using it? (`ss -ltnp` names it)") from e
    except RuntimeError as e:
        raise ListenError(f"{what} stopped before it listened on {server.listen}") from e


def run_service(main: Coroutine[Any, Any, None]) -> None:
    """Run a service's main coroutine to its end on uvloop (it halves the event loop's cost
    per request), or on asyncio's own loop without it."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main)
