"""uvicorn servers in a process that runs several listeners and handles its own signals."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import uvicorn

from llmgw.config import parse_listen


class QuietServer(uvicorn.Server):
    """A uvicorn server that leaves signals to the process, which runs more than it."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def quiet_server(app: Any, listen: str) -> QuietServer:
    """app served on listen (HOST:PORT), uvicorn logging warnings only."""
    host, port = parse_listen(listen)
    # No access log: a line per request costs the gateway more than its own work.
    return QuietServer(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                      access_log=False))


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
