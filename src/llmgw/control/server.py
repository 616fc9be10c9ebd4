"""`llmgw server`: the admin API, the agent API and the gateway in one process."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Iterator
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from llmgw.config import ServerConfig, parse_listen
from llmgw.control.admin_api import make_admin_app
from llmgw.control.agent_api import AgentAPI, AgentAPIServer, mtls_context
from llmgw.control.store import Store

log = logging.getLogger("llmgw.server")


class _QuietServer(uvicorn.Server):
    """A uvicorn server that leaves signals to the process, which runs several of them."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _uvicorn(app: FastAPI, listen: str) -> _QuietServer:
    host, port = parse_listen(listen)
    return _QuietServer(uvicorn.Config(app, host=host, port=port, log_level="warning"))


async def serve(config: ServerConfig) -> None:
    """Run until SIGTERM or SIGINT, then stop every listener and close the database."""
    store = Store(Path(config.state_dir) / "control.db")
    agent_host, agent_port = parse_listen(config.agent_listen)
    agent_api = AgentAPIServer(
        agent_host,
        agent_port,
        mtls_context(config.tls.ca, config.tls.cert, config.tls.key),
        AgentAPI(store),
    )
    servers = [
        _uvicorn(make_admin_app(store, node_timeout_s=config.node_timeout_s), config.admin_listen)
    ]
    loop = asyncio.get_running_loop()

    def stop(sig: signal.Signals) -> None:
        log.info("received %s; shutting down", sig.name)
        for s in servers:
            s.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop, sig)
    agent_api.start()
    log.info(
        "control plane: admin %s, agent API %s (mTLS), state %s",
        config.admin_listen, config.agent_listen, config.state_dir,
    )
    try:
        await asyncio.gather(*(s.serve() for s in servers))
    finally:
        agent_api.stop()
        store.close()
        log.info("control plane stopped")
