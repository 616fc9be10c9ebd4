"""`llmgw mirror serve`: the bytes server, the management API and the downloads, one process."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import uvicorn

from llmgw.config import connect_host, parse_listen
from llmgw.mirror import _metrics
from llmgw.mirror._api import make_api
from llmgw.mirror._bytes import BytesServer
from llmgw.mirror._downloads import Manager
from llmgw.mirror._errors import MirrorError

log = logging.getLogger("llmgw.mirror")


@dataclass(frozen=True)
class Options:
    dir: Path
    listen: str = ":8081"
    api_listen: str = "127.0.0.1:8082"
    # Where nodes fetch from: http://ADDR:PORT[/path]; default: the listen address from here.
    base: str = ""

    def base_url(self) -> str:
        return (self.base or f"http://{connect_host(self.listen)}").rstrip("/")


class _QuietServer(uvicorn.Server):
    """A uvicorn server that leaves signals to the process, which runs more than it."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve(options: Options) -> None:
    """Run until SIGTERM or SIGINT; downloads in flight stop and resume at the next start."""
    manager = Manager(options.dir, options.base_url())
    manager.start()
    served = _metrics.ServedCounter()
    bytes_server = BytesServer(manager, urlsplit(options.base_url()).path, served)
    host, port = parse_listen(options.listen)
    try:
        await bytes_server.start(host, port)
    except OSError as e:
        manager.stop()
        raise MirrorError(f"cannot listen on {options.listen} for the bytes server: {e}") from e
    api_host, api_port = parse_listen(options.api_listen)
    about = {"dir": str(options.dir), "base": options.base_url()}
    api = _QuietServer(uvicorn.Config(
        make_api(manager, about=about, metrics=_metrics.registry(manager, served)),
        host=api_host, port=api_port, log_level="warning",
    ))
    loop = asyncio.get_running_loop()

    def stop(sig: signal.Signals) -> None:
        log.info("received %s; shutting down", sig.name)
        api.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop, sig)
    log.info("mirror: %s; bytes on %s as %s; API on %s",
             options.dir, options.listen, options.base_url(), options.api_listen)
    try:
        await api.serve()
    finally:
        await bytes_server.close()
        await asyncio.to_thread(manager.stop)
        log.info("mirror stopped")
