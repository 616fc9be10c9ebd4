"""`llmgw server`: the admin API and the agent API in one process (the gateway runs apart,
`llmgw gateway`, so that a restart of this one drops no user request)."""

from __future__ import annotations

import asyncio
import gc
import logging
import resource
import socket
import time
from collections.abc import Callable
from pathlib import Path

from llmgw.config import ServerConfig, connect_host, parse_listen
from llmgw.control.admin_api import make_admin_app
from llmgw.control.agent_api import AgentAPI, AgentAPIServer, mtls_context
from llmgw.control.leadership import Identity, Leadership, control_plane_id
from llmgw.control.metrics import ControlPlaneMetrics
from llmgw.control.scheduler import Scheduler
from llmgw.host import pki
from llmgw.http1.server import Http1Server
from llmgw.http1.service import listening, on_stop_signals
from llmgw.store import LeaseLost, Store, StoreError

log = logging.getLogger("llmgw.server")


# A full sweep over thousands of nodes' connections stalls the agent API for ~0.4 s on
# 2 busy cores: rare enough here to stay out of the p99, often enough to free the
# cycles of closed connections.
GC_EVERY_S = 600.0
# A stopping control plane lets admin requests under way finish this long, then cuts them.
ADMIN_DRAIN_S = 30.0
# Between ticks the scheduler reads the gateways' demand rows this often: a request that
# starts waiting for a model at zero is placed within this, not at the next tick. Each look
# costs the control plane about 0.8 ms of CPU (a read and a thread's hop): every 0.1 s
# made an idle control plane's CPU 27 ms/s against 9 without it; every 0.25 s, 15.5.
DEMAND_LOOK_S = 0.25


def tune_gc() -> None:
    """Collect garbage in rare full sweeps instead of frequent automatic ones.

    Every node holds a connection, and a connection is a few dozen objects: with thousands
    of nodes, the automatic full collections scanned them all every few seconds and
    stalled every heartbeat for 200 ms (bench/heartbeats.py, p99). Young objects are still
    collected often; the full sweep runs every GC_EVERY_S from the scheduling loop.
    """
    gc.set_threshold(100_000, 50, 1_000)


async def _schedule(scheduler: Scheduler, leadership: Leadership,
                    stopping: asyncio.Event) -> None:
    """Every second until stopped: beat this control plane's row, take or renew the
    scheduler lease, and while holding it reconcile replicas with the catalog and the
    nodes, each plan fenced by the lease's epoch."""
    last_gc = time.monotonic()
    waited: frozenset[str] = frozenset()
    while not stopping.is_set():
        lease = None
        try:
            lease = await asyncio.to_thread(leadership.step)
            if lease is not None:
                await asyncio.to_thread(scheduler.tick, lease)
        except LeaseLost as e:
            leadership.lost(e)
        except StoreError as e:
            leadership.unreachable(e)
        except Exception:  # one bad tick must not take the control plane down
            log.exception("scheduling failed; trying again in a second")
        if time.monotonic() - last_gc > GC_EVERY_S:
            await asyncio.to_thread(gc.collect)
            last_gc = time.monotonic()
        waited = await _next_tick(scheduler.store, stopping, lease is not None, waited)


async def _next_tick(store: Store, stopping: asyncio.Event, leading: bool,
                     waited: frozenset[str]) -> frozenset[str]:
    """Wait a second, or less: until stopped or, while this control plane schedules, until
    requests wait for a model none waited for at the last look (the gateway writes its
    demand row as a wait begins). Returns the models waited for at the last look."""
    deadline = time.monotonic() + 1.0
    while not stopping.is_set():
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            await asyncio.wait_for(stopping.wait(), min(left, DEMAND_LOOK_S if leading else left))
        except TimeoutError:
            pass
        if not leading:
            continue
        try:
            now = frozenset(m for m, use in (await asyncio.to_thread(store.uses)).items()
                            if use.waiting)
        except StoreError:
            leading = False  # the tick says so; no look until then
            continue
        if now - waited:
            return now
        waited = now
    return waited


def _ca(config: ServerConfig) -> pki.KeyPair | None:
    """The cluster CA with its key, or None (then no node can join here, and says so)."""
    key = Path(config.ca_key or Path(config.tls.ca).with_name("ca-key.pem"))
    if not key.exists():
        log.warning("no CA key at %s: nodes cannot join or renew through this control plane",
                    key)
        return None
    try:
        return pki.KeyPair(pki.load_cert(config.tls.ca), pki.load_key(key))
    except PermissionError:
        log.warning("cannot read the CA key %s as this user: nodes cannot join or renew "
                    "through this control plane; `pytest provision/` shares it with llmgw", key)
        return None


def agent_api_server(config: ServerConfig, store: Store,
                     metrics: ControlPlaneMetrics | None = None) -> AgentAPIServer:
    """The agent API; with metrics, each heartbeat is counted and timed."""
    host, port = parse_listen(config.agent_listen)
    tls = (config.tls.ca, config.tls.cert, config.tls.key)
    api = AgentAPI(store, _ca(config), node_timeout_s=config.node_timeout_s,
                   mirror_url=config.mirror.url,
                   control_planes=_live_control_planes(store, config),
                   control_plane=identity(config).id)
    if metrics is not None:
        api.heartbeat_timer = metrics.heartbeats.seconds.time
    return AgentAPIServer(host, port, mtls_context(*tls), api, tls=tls,
                          limits=config.agent_http)


def _live_control_planes(store: Store, config: ServerConfig) -> Callable[[], list[str]]:
    """The agent API URLs of the control planes that beat within the node timeout, this
    one first, for heartbeat answers: read at most once a second (every node asks)."""
    own = identity(config).agent_url
    cached: list[tuple[float, list[str]]] = []

    def live() -> list[str]:
        now = time.monotonic()
        if cached and now - cached[0][0] < 1.0:
            return cached[0][1]
        try:
            seen = store.control_planes()
        except StoreError:
            return cached[0][1] if cached else [own]
        fresh = store.clock() - config.node_timeout_s
        urls = [own, *(cp["agent_url"] for cp in seen
                       if cp["last_seen"] >= fresh and cp["agent_url"] != own)]
        cached[:] = [(now, urls)]
        return urls

    return live


def identity(config: ServerConfig) -> Identity:
    """This control plane as its row shows it: its id (kept in state_dir) and the URLs
    others reach it at (a wildcard listen address as this host's name)."""
    def url(scheme: str, listen: str) -> str:
        host, port = parse_listen(listen)
        if host in ("0.0.0.0", "::", ""):
            return f"{scheme}://{socket.gethostname()}:{port}"
        return f"{scheme}://{connect_host(listen)}"

    return Identity(control_plane_id(config.state_dir), url("https", config.agent_listen),
                    url("http", config.admin_listen), time.time())


def _raise_open_files() -> None:
    """Take the whole hard limit of open files: every node holds a connection open."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    log.info("open files: up to %s", hard)


async def serve(config: ServerConfig, *, admin_token_hash: Path | None) -> None:
    """Run until SIGTERM or SIGINT, then stop every listener and close the database.

    admin_token_hash: the file holding the admin token's sha256 (host/admin_token.py)."""
    _raise_open_files()
    tune_gc()
    store = Store(config.store_at())
    metrics = ControlPlaneMetrics(
        store, config.node_timeout_s,
        gateway_url=f"http://{connect_host(config.gateway_metrics_listen)}",
        certificates={"ca": config.tls.ca, "server": config.tls.cert,
                      "gateway": config.gateway_tls.cert})
    agent_api = agent_api_server(config, store, metrics)
    admin = make_admin_app(store, node_timeout_s=config.node_timeout_s,
                           token_hash=admin_token_hash, metrics=metrics,
                           on_node_removed=agent_api.revoke, drift=agent_api.api.drift)
    admin_server = Http1Server(admin, config.admin_listen, drain_s=ADMIN_DRAIN_S)
    scheduler = Scheduler(store, config.node_timeout_s, on_evict=metrics.evicted)
    leadership = Leadership(store, identity(config))
    stopping = asyncio.Event()

    def stop() -> None:
        stopping.set()
        admin_server.should_exit = True

    on_stop_signals(log, stop)
    agent_api.start()
    try:
        serving = await listening(admin_server, "the admin API")
        log.info("control plane %s: admin %s, agent API %s (mTLS), state %s",
                 leadership.me.id, config.admin_listen, config.agent_listen, config.state_dir)
        await asyncio.gather(serving, _schedule(scheduler, leadership, stopping))
    finally:
        leadership.release()
        agent_api.stop()
        store.close()
        log.info("control plane stopped")
