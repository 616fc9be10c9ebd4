"""`llmgw server`: the admin API, the agent API and the gateway in one process."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import resource
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from llmgw import pki
from llmgw.config import ServerConfig, parse_listen
from llmgw.control.admin_api import make_admin_app
from llmgw.control.agent_api import AgentAPI, AgentAPIServer, mtls_context
from llmgw.control.gateway import make_gateway_app, upstream_client
from llmgw.control.scheduler import Scheduler
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


# A full sweep over thousands of nodes' connections stalls the agent API for ~0.4 s on
# 2 busy cores: rare enough here to stay out of the p99, often enough to free the
# cycles of closed connections.
GC_EVERY_S = 600.0


def tune_gc() -> None:
    """Collect garbage in rare full sweeps instead of frequent automatic ones.

    Every node holds a connection, and a connection is a few dozen objects: with thousands
    of nodes, the automatic full collections scanned them all every few seconds and
    stalled every heartbeat for 200 ms (bench/heartbeats.py, p99). Young objects are still
    collected often; the full sweep runs every GC_EVERY_S from the scheduling loop.
    """
    gc.set_threshold(100_000, 50, 1_000)


async def _schedule(scheduler: Scheduler, stopping: asyncio.Event) -> None:
    """Reconcile replicas with the catalog and the nodes every second until stopped."""
    last_gc = time.monotonic()
    while not stopping.is_set():
        try:
            await asyncio.to_thread(scheduler.tick)
        except Exception:  # one bad tick must not take the control plane down
            log.exception("scheduling failed; trying again in a second")
        if time.monotonic() - last_gc > GC_EVERY_S:
            await asyncio.to_thread(gc.collect)
            last_gc = time.monotonic()
        try:
            await asyncio.wait_for(stopping.wait(), timeout=1.0)
        except TimeoutError:
            pass


def _ca(config: ServerConfig) -> pki.KeyPair | None:
    """The cluster CA with its key, or None (then no node can join here, and says so)."""
    key = Path(config.ca_key or Path(config.tls.ca).with_name("ca-key.pem"))
    if not key.exists():
        log.warning("no CA key at %s: nodes cannot join or renew through this control plane",
                    key)
        return None
    return pki.KeyPair(pki.load_cert(config.tls.ca), pki.load_key(key))


def agent_api_server(config: ServerConfig, store: Store) -> AgentAPIServer:
    host, port = parse_listen(config.agent_listen)
    tls = (config.tls.ca, config.tls.cert, config.tls.key)
    api = AgentAPI(store, _ca(config), node_timeout_s=config.node_timeout_s,
                   mirror_url=config.mirror.url)
    return AgentAPIServer(host, port, mtls_context(*tls), api, tls=tls)


def _raise_open_files() -> None:
    """Take the whole hard limit of open files: every node holds a connection open."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    log.info("open files: up to %s", hard)


async def serve(config: ServerConfig) -> None:
    """Run until SIGTERM or SIGINT, then stop every listener and close the database."""
    _raise_open_files()
    tune_gc()
    store = Store(Path(config.state_dir) / "control.db")
    agent_api = agent_api_server(config, store)
    upstream = upstream_client()
    admin = make_admin_app(store, node_timeout_s=config.node_timeout_s,
                           on_node_removed=agent_api.revoke)
    servers = [
        _uvicorn(admin, config.admin_listen),
        _uvicorn(make_gateway_app(store, tokens=config.tokens, upstream=upstream),
                 config.gateway_listen),
    ]
    scheduler = Scheduler(store, config.node_timeout_s)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()

    def stop(sig: signal.Signals) -> None:
        log.info("received %s; shutting down", sig.name)
        stopping.set()
        for s in servers:
            s.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop, sig)
    agent_api.start()
    log.info(
        "control plane: admin %s, agent API %s (mTLS), gateway %s, state %s",
        config.admin_listen, config.agent_listen, config.gateway_listen, config.state_dir,
    )
    try:
        await asyncio.gather(*(s.serve() for s in servers), _schedule(scheduler, stopping))
    finally:
        agent_api.stop()
        await upstream.aclose()
        store.close()
        log.info("control plane stopped")
