"""`llmgw server`: the admin API, the agent API and the gateway in one process."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from llmgw._serving import on_stop_signals, quiet_server
from llmgw.config import ServerConfig, parse_listen
from llmgw.control._upstream import Timeouts, Upstream
from llmgw.control.admin_api import make_admin_app
from llmgw.control.agent_api import AgentAPI, AgentAPIServer, mtls_context
from llmgw.control.gateway import make_gateway_app
from llmgw.control.metrics import ControlPlaneMetrics
from llmgw.control.scheduler import Scheduler
from llmgw.control.store import Store

log = logging.getLogger("llmgw.server")


async def _schedule(scheduler: Scheduler, stopping: asyncio.Event) -> None:
    """Reconcile replicas with the catalog and the nodes every second until stopped."""
    while not stopping.is_set():
        try:
            await asyncio.to_thread(scheduler.tick)
        except Exception:  # one bad tick must not take the control plane down
            log.exception("scheduling failed; trying again in a second")
        try:
            await asyncio.wait_for(stopping.wait(), timeout=1.0)
        except TimeoutError:
            pass


async def serve(config: ServerConfig, *, admin_token_hash: Path | None) -> None:
    """Run until SIGTERM or SIGINT, then stop every listener and close the database.

    admin_token_hash: the file holding the admin token's sha256 (admin_token.py)."""
    store = Store(Path(config.state_dir) / "control.db")
    metrics = ControlPlaneMetrics(store, config.node_timeout_s)
    agent_host, agent_port = parse_listen(config.agent_listen)
    api = AgentAPI(store)
    api.heartbeat = metrics.heartbeats.wrap(api.heartbeat)  # type: ignore[method-assign]
    agent_api = AgentAPIServer(
        agent_host,
        agent_port,
        mtls_context(config.tls.ca, config.tls.cert, config.tls.key),
        api,
    )
    upstream = Upstream(Timeouts(config.upstream_connect_timeout_s,
                                 config.upstream_read_timeout_s))
    gateway = make_gateway_app(store, tokens=config.tokens, upstream=upstream,
                               metrics=metrics.gateway,
                               max_body_bytes=int(config.gateway_max_body_bytes))
    admin = make_admin_app(store, node_timeout_s=config.node_timeout_s,
                           token_hash=admin_token_hash, metrics=metrics)
    servers = [quiet_server(admin, config.admin_listen),
               quiet_server(gateway, config.gateway_listen)]
    scheduler = Scheduler(store, config.node_timeout_s)
    stopping = asyncio.Event()

    def stop() -> None:
        stopping.set()
        for s in servers:
            s.should_exit = True

    on_stop_signals(log, stop)
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
