"""`llmgw gateway`: the gateway in processes of its own, restarted without losing a request.

A small master holds the listening sockets (the gateway's, from systemd's socket unit when
there is one, and its metrics listener) and runs the serving worker as a child that
inherits them. SIGHUP starts a new worker (new code, server.yaml read again) on the same
sockets and, once it serves, drains the old one; SIGTERM drains the worker, then exits.
Workers are stateless: each reads the routing table from the control plane's SQLite store.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

from llmgw import __version__
from llmgw.config import ServerConfig, load_server, parse_listen
from llmgw.gateway._forward import Forwarder
from llmgw.gateway._slottable import RouteDecisions
from llmgw.gateway.app import make_gateway_app
from llmgw.gateway.metrics import GatewayMetrics
from llmgw.http1.asgi import Receive, Scope, Send
from llmgw.http1.limits import Limits
from llmgw.http1.server import Http1Server
from llmgw.http1.service import on_stop_signals
from llmgw.store import SchemaError, Store

log = logging.getLogger("llmgw.gateway")

# The worker finds its sockets' descriptors here: gateway, metrics, ready pipe.
FDS_ENV = "LLMGW_GATEWAY_FDS"
SD_LISTEN_FDS_START = 3
WORKER_START_TIMEOUT_S = 30.0
# A routing-table read waits this long for a lock at most: requests wait behind it.
READ_WAIT_S = 0.2
# How long a worker waits for the control plane to make or migrate the store's schema
# (within WORKER_START_TIMEOUT_S).
SCHEMA_WAIT_S = 20.0
BACKLOG = 4096


def systemd_sockets() -> list[socket.socket]:
    """The sockets systemd passed (sd_listen_fds: $LISTEN_PID is us, $LISTEN_FDS of them
    from fd 3); [] when started otherwise. The variables are removed: children are not
    meant to take them for their own."""
    pid, count = os.environ.pop("LISTEN_PID", ""), os.environ.pop("LISTEN_FDS", "")
    os.environ.pop("LISTEN_FDNAMES", None)
    if not (pid.isdigit() and int(pid) == os.getpid() and count.isdigit()):
        return []
    found = [socket.socket(fileno=SD_LISTEN_FDS_START + i) for i in range(int(count))]
    for sock in found:
        sock.set_inheritable(True)
    return found


def bind(listen: str) -> socket.socket:
    """A listening socket on listen (HOST:PORT) with SO_REUSEPORT, so that several gateway
    processes may serve one address; inheritable, for the workers."""
    host, port = parse_listen(listen)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {listen} for the gateway: {e.strerror}; "
                      "is another program using it? (`ss -ltnp` names it)") from e
    sock.set_inheritable(True)
    return sock


@dataclass
class Master:
    """Holds the sockets and keeps one serving worker; old workers drain in the background."""

    config_path: Path
    config: ServerConfig
    sockets: tuple[socket.socket, socket.socket]
    current: subprocess.Popen[bytes] | None = None
    draining: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start_worker(self) -> subprocess.Popen[bytes] | None:
        """A new worker on the sockets once it serves; None (said in the log) when it
        exited or did not say it serves within WORKER_START_TIMEOUT_S."""
        ready_r, ready_w = os.pipe()
        fds = (*(s.fileno() for s in self.sockets), ready_w)
        env = {**os.environ, FDS_ENV: ",".join(map(str, fds))}
        argv = [sys.executable, "-m", "llmgw", "gateway", "--config", str(self.config_path),
                "--worker"]
        try:
            worker = subprocess.Popen(argv, pass_fds=fds, env=env, stdin=subprocess.DEVNULL)
        finally:
            os.close(ready_w)
        try:
            said = _read_ready(ready_r, WORKER_START_TIMEOUT_S)
        finally:
            os.close(ready_r)
        if said:
            log.info("gateway worker %s serves %s", worker.pid, self.config.gateway_listen)
            return worker
        code = worker.poll()
        if code is None:
            worker.kill()
            worker.wait()
        why = (f"exited with {code}" if code is not None
               else f"did not serve within {WORKER_START_TIMEOUT_S:.0f} s")
        log.error("a new gateway worker %s; the old one, if any, goes on serving; the lines "
                  "above say why", why)
        return None

    def replace(self) -> None:
        """A new worker first, then the old one drains: the sockets never go unserved."""
        try:
            fresh = load_server(self.config_path)
        except Exception as e:  # a broken server.yaml must not stop the serving worker
            log.error("SIGHUP: %s; the running worker goes on serving", e)
            return
        if (fresh.gateway_listen, fresh.gateway_metrics_listen) != (
                self.config.gateway_listen, self.config.gateway_metrics_listen):
            log.warning("server.yaml names other gateway addresses; this process keeps "
                        "%s and %s: restart llmgw-gateway to listen on the new ones",
                        self.config.gateway_listen, self.config.gateway_metrics_listen)
        worker = self.start_worker()
        if worker is None:
            return
        old, self.current = self.current, worker
        if old is not None:
            old.send_signal(signal.SIGTERM)
            self.draining.append(old)

    def reap(self) -> None:
        """Forget drained workers; start another when the serving one died."""
        for w in [w for w in self.draining if w.poll() is not None]:
            self.draining.remove(w)
            log.info("gateway worker %s drained and exited (%s)", w.pid, w.returncode)
        if self.current is not None and self.current.poll() is not None:
            log.error("gateway worker %s exited (%s) while serving; starting another",
                      self.current.pid, self.current.returncode)
            time.sleep(1.0)  # a worker that fails at once must not spin
            self.current = self.start_worker()
        elif self.current is None:
            time.sleep(1.0)
            self.current = self.start_worker()

    def stop(self) -> None:
        """Every worker drains (gateway_drain_s), then is killed if it still runs."""
        workers = [w for w in (self.current, *self.draining) if w is not None]
        for w in workers:
            if w.poll() is None:
                w.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.config.gateway_drain_s + 5.0
        for w in workers:
            try:
                w.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("gateway worker %s still runs %.0f s after SIGTERM; killing it",
                          w.pid, self.config.gateway_drain_s + 5.0)
                w.kill()
                w.wait()


def _read_ready(fd: int, timeout_s: float) -> bool:
    """Whether the worker wrote its ready byte before the timeout (EOF: it exited)."""
    readable, _, _ = select.select([fd], [], [], timeout_s)
    return bool(readable) and os.read(fd, 1) == b"r"


def run_master(config_path: Path) -> int:
    """`llmgw gateway`: until SIGTERM or SIGINT; SIGHUP hands over to a new worker."""
    config = load_server(config_path)
    passed = systemd_sockets()
    gateway = passed[0] if passed else bind(config.gateway_listen)
    sockets = (gateway, bind(config.gateway_metrics_listen))
    master = Master(config_path, config, sockets)
    got: list[int] = []
    for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _f: got.append(s))
    log.info("gateway on %s%s, metrics on %s, state %s; SIGHUP restarts the worker without "
             "dropping a connection", config.gateway_listen,
             " (socket from systemd)" if passed else "", config.gateway_metrics_listen,
             config.state_dir)
    master.current = master.start_worker()
    if master.current is None:
        return 1
    while True:
        while got:
            received = got.pop(0)
            if received == signal.SIGHUP:
                log.info("received SIGHUP: starting a new worker, then draining the old one")
                master.replace()
                continue
            log.info("received %s: draining (up to %.0f s), then exiting",
                     signal.Signals(received).name, config.gateway_drain_s)
            master.stop()
            return 0
        master.reap()
        time.sleep(0.1)


def metrics_app(registry: CollectorRegistry) -> Any:
    """GET /metrics: the registry's exposition text (the admin API's /metrics appends it)."""
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        found = scope["path"] == "/metrics"
        body = generate_latest(registry) if found else b"only /metrics is served here\n"
        ctype = CONTENT_TYPE_LATEST if found else "text/plain"
        await send({"type": "http.response.start", "status": 200 if found else 404,
                    "headers": [(b"content-type", ctype.encode()),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    return app


def worker_fds() -> tuple[socket.socket, socket.socket, int]:
    """The gateway and metrics sockets and the ready pipe the master handed down."""
    raw = os.environ.pop(FDS_ENV, "")
    parts = raw.split(",")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise SystemExit(f"llmgw gateway --worker: {FDS_ENV} is {raw!r}, not the three "
                         "descriptors the master hands down; run `llmgw gateway` instead")
    g, m, ready = map(int, parts)
    return socket.socket(fileno=g), socket.socket(fileno=m), ready


async def _say_ready(servers: list[Any], ready_fd: int) -> None:
    await asyncio.gather(*(s.wait_started() for s in servers))
    os.write(ready_fd, b"r")
    os.close(ready_fd)


async def _watch_master(stop: Any) -> None:
    """Drain and exit when the master is gone (killed): no worker outlives it for long."""
    parent = os.getppid()
    while os.getppid() == parent:
        await asyncio.sleep(1.0)
    log.warning("the gateway master (pid %s) is gone; draining and exiting", parent)
    stop()


# server.yaml keys only the control plane reads: a change to them needs no new worker.
CONTROL_PLANE_ONLY = {"admin_listen", "agent_listen", "advertise", "tls", "ca_key",
                      "node_timeout_s", "admin_token_hash", "mirror"}


def settings_digest(config: ServerConfig) -> str:
    """The sha256 of the server.yaml settings a gateway worker serves by (all but the
    control plane's own)."""
    data = config.model_dump(exclude=CONTROL_PLANE_ONLY)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def _info(registry: CollectorRegistry, config: ServerConfig) -> None:
    """llmgw_gateway_info: which llmgw and which settings (settings_digest) this worker
    serves; provisioning compares it with server.yaml to know whether a reload is due."""
    Gauge("llmgw_gateway_info", "The llmgw version and server.yaml settings (sha256) the "
          "gateway serves", ["version", "config_sha256"], registry=registry).labels(
        __version__, settings_digest(config)).set(1)


# A chunked body's framing (sizes, extensions, trailers) beyond the gateway's own body
# limit: within it, a body too large is answered by the gateway (JSON, naming the setting).
BODY_FRAMING_SLACK_BYTES = 1 << 20


def gateway_limits(config: ServerConfig) -> Limits:
    """The HTTP core's limits for the gateway: gateway_http, with the body limit on the
    wire above gateway_max_body_bytes unless gateway_http.max_body_bytes is set (to other
    than its default)."""
    limits = config.gateway_http
    if limits.max_body_bytes == Limits().max_body_bytes:
        limits = replace(limits, max_body_bytes=max(
            limits.max_body_bytes, config.gateway_max_body_bytes + BODY_FRAMING_SLACK_BYTES))
    return limits


async def open_store(config: ServerConfig, wait_s: float = SCHEMA_WAIT_S) -> Store:
    """The store, read as the control plane made it: the gateway never migrates. A schema
    not yet made or not yet migrated (both started at once, at boot or in an upgrade) is
    waited for, wait_s at most, then refused saying why (SchemaError)."""
    deadline = time.monotonic() + wait_s
    said = False
    while True:
        try:
            return Store(config.store_at(), busy_timeout_s=READ_WAIT_S, migrate=False)
        except SchemaError as e:
            if time.monotonic() >= deadline:
                raise
            if not said:
                log.info("waiting up to %.0f s for the control plane to make the store's "
                         "schema: %s", wait_s, e)
                said = True
        await asyncio.sleep(0.5)


async def serve_worker(config_path: Path) -> None:
    """One worker: the gateway and its metrics on the inherited sockets, until SIGTERM."""
    config = load_server(config_path)
    gateway_sock, metrics_sock, ready_fd = worker_fds()
    store = await open_store(config)
    registry = CollectorRegistry()
    _info(registry, config)
    app = make_gateway_app(store, config, metrics=GatewayMetrics(registry))
    registry.register(RouteDecisions(app.balancer.decisions))
    servers = [Http1Server(app, drain_s=config.gateway_drain_s,
                           certfile=config.gateway_tls.cert, keyfile=config.gateway_tls.key,
                           fast=Forwarder(app), limits=gateway_limits(config)),
               Http1Server(metrics_app(registry), drain_s=1.0)]

    def stop() -> None:
        for s in servers:
            s.should_exit = True

    on_stop_signals(log, stop)
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, lambda: None)  # master's
    helpers = [asyncio.create_task(_say_ready(servers, ready_fd)),
               asyncio.create_task(_watch_master(stop))]
    try:
        await asyncio.gather(servers[0].serve(sockets=[gateway_sock]),
                             servers[1].serve(sockets=[metrics_sock]))
    finally:
        for task in helpers:
            task.cancel()
        await app.upstream.aclose()
        store.close()
        log.info("gateway worker %s stopped", os.getpid())
