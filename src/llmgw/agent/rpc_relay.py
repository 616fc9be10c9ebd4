"""llama.cpp's RPC traffic between the nodes of a split replica, carried over mutual TLS with
the cluster's certificates: rpc-server itself listens on 127.0.0.1 only, and the main node's
engine talks to loopback ports of its own agent.

    main node                                        worker
    llama-server --rpc 127.0.0.1:P  ->  MainRelay  ==TLS==>  WorkerRelay  ->  rpc-server
                                        (loopback)           (management    (127.0.0.1:R)
                                                              address)

llama.cpp's RPC protocol has no authentication: whoever reaches rpc-server may write its
memory. So a WorkerRelay admits one peer: a certificate of the cluster CA (checked in the
handshake) whose node name is the main node the control plane assigned to that replica
(and, where given, whose SHA-256 fingerprint is one of those pinned). Any other peer is
closed as soon as its handshake ends, before a byte of it is read and before rpc-server is
connected to. Node certificates are clientAuth certificates (the control plane signs them
so), which OpenSSL refuses as a server's: the main side therefore checks the worker's
certificate itself after the handshake (chained to the cluster CA, valid now, the expected
node name), again before a byte flows.

A lost peer fails fast: TCP keepalive on every relayed connection notices a silent one
within KEEPALIVE_IDLE_S + KEEPALIVE_COUNT * KEEPALIVE_INTERVAL_S, and either side closing
closes the other, so the main engine sees its RPC connection end (llama.cpp's RPC has no
failover: the engine then stops, and the agent reports the replica down).

All of one relay runs on one event loop in a thread of its own; cpu_seconds() is that
thread's CPU time (TLS included), which bench/split.py reports per token.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import functools
import hashlib
import logging
import shutil
import socket
import ssl
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from cryptography import x509

from llmgw.config import TLSFiles
from llmgw.errors import Error
from llmgw.host import pki
from llmgw.model.engine_args import rpc_server_args

log = logging.getLogger("llmgw.agent.rpc_relay")

LOOPBACK = "127.0.0.1"
# One read's worth: set_tensor carries whole weight tensors, so large reads mean fewer
# records and wake-ups while a model loads.
CHUNK = 256 * 1024
HANDSHAKE_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 10.0
KEEPALIVE_IDLE_S = 2
KEEPALIVE_INTERVAL_S = 1
KEEPALIVE_COUNT = 3
START_TIMEOUT_S = 10.0


def rpc_server_command(binary: str, port: int, profile_args: list[str]) -> list[str]:
    """A worker's rpc-server: on 127.0.0.1:port only (the relay is its one way in), with
    the profile's rpc-server flags that engine_args allows (its threads), nothing else.
    Line-buffered where stdbuf is found, so its log says each connection as it comes."""
    stdbuf = shutil.which("stdbuf")
    return [*([stdbuf, "-oL"] if stdbuf else []), binary, "--host", LOOPBACK,
            "--port", str(port), *rpc_server_args(profile_args)]


def main_flags(endpoints: str, worker_layers: int) -> list[str]:
    """The main engine's flags for its workers: their relayed endpoints, and how many of
    the model's layers they hold (llama.cpp gives the last layers to its devices, here the
    RPC servers, shared by their free memory; the rest stay on the main node)."""
    return ["--rpc", endpoints, "--n-gpu-layers", str(worker_layers)]


class RelayError(Error):
    """A relay could not start (its TLS files, its address); the message says which."""


@dataclass(frozen=True)
class Worker:
    """One worker of a split replica, as its main node reaches it: its node name (the CN
    its certificate must carry) and its relay's address on the management network."""

    node: str
    host: str
    port: int


@dataclass
class Counters:
    """What a relay saw: connections carried, peers refused (with why), bytes each way."""

    carried: int = 0
    refused: list[str] = field(default_factory=list)
    bytes_in: int = 0
    bytes_out: int = 0


def fingerprint(cert: x509.Certificate) -> str:
    """A certificate's pin: sha256 of its DER, lower-case hex."""
    from cryptography.hazmat.primitives.serialization import Encoding

    return hashlib.sha256(cert.public_bytes(Encoding.DER)).hexdigest()


def _load(tls: TLSFiles, what: str) -> tuple[x509.Certificate, Callable[[ssl.SSLContext], None]]:
    try:
        ca = pki.load_cert(tls.ca)
    except (OSError, pki.PKIError) as e:
        raise RelayError(f"the {what} cannot load the cluster CA {tls.ca}: {e}; run "
                         "`pytest provision/` to issue the node's TLS files") from e

    def prove(ctx: ssl.SSLContext) -> None:
        try:
            ctx.load_cert_chain(tls.cert, tls.key)
        except (OSError, ssl.SSLError) as e:
            raise RelayError(
                f"the {what} cannot load the node's certificate {tls.cert} and key {tls.key}: "
                f"{e}; run `pytest provision/` to issue them, or fix tls in agent.yaml") from e
    return ca, prove


def _server_context(tls: TLSFiles) -> ssl.SSLContext:
    _, prove = _load(tls, "RPC relay")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.verify_mode = ssl.CERT_REQUIRED
    try:
        ctx.load_verify_locations(cafile=tls.ca)
    except (OSError, ssl.SSLError) as e:
        raise RelayError(f"the RPC relay cannot load the cluster CA {tls.ca}: {e}") from e
    prove(ctx)
    return ctx


def _client_context(tls: TLSFiles) -> tuple[ssl.SSLContext, x509.Certificate]:
    ca, prove = _load(tls, "RPC relay")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    # The worker's certificate is a clientAuth one (see the module's docstring): checked by
    # _peer_refusal against the CA and the expected node after the handshake instead.
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    prove(ctx)
    return ctx, ca


def _peer_refusal(der: bytes | None, ca: x509.Certificate | None, node: str,
                  pins: frozenset[str]) -> str:
    """Why this peer certificate may not be carried to or from; '' when it may."""
    if not der:
        return "it showed no certificate"
    cert = x509.load_der_x509_certificate(der)
    cn = pki.common_name(cert)
    if ca is not None:
        if not pki.chains_to(cert, ca):
            return f"its certificate (CN {cn!r}) is not signed by this cluster's CA"
        now = dt.datetime.now(dt.UTC)
        if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
            return f"its certificate (CN {cn!r}) is not valid now"
    if cn != node:
        return f"its certificate names node {cn!r}, not {node!r}, the node assigned"
    if pins and fingerprint(cert) not in pins:
        return f"its certificate for {cn!r} is not the one pinned for this replica"
    return ""


def _keepalive(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_COUNT)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                count: Callable[[int], None]) -> None:
    try:
        while data := await reader.read(CHUNK):
            count(len(data))
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError, ssl.SSLError):
        pass
    finally:
        writer.close()


async def _splice(a: tuple[asyncio.StreamReader, asyncio.StreamWriter],
                  b: tuple[asyncio.StreamReader, asyncio.StreamWriter],
                  counters: Counters) -> None:
    """Bytes both ways until either side ends; then both are closed."""
    def inbound(n: int) -> None:
        counters.bytes_in += n

    def outbound(n: int) -> None:
        counters.bytes_out += n

    tasks = [asyncio.ensure_future(_pump(a[0], b[1], inbound)),
             asyncio.ensure_future(_pump(b[0], a[1], outbound))]
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for w in (a[1], b[1]):
        w.close()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _until_stopped(handler: Coroutine[Any, Any, None],
                         writer: asyncio.StreamWriter) -> None:
    """handler, ended quietly when the relay stops (its loop cancels it): asyncio's stream
    server would log the cancellation of each connection as an error."""
    try:
        await handler
    except asyncio.CancelledError:
        writer.close()


class _Loop:
    """An event loop in a thread of its own, started with the relay's listeners."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._servers: list[asyncio.Server] = []

    def start(self) -> None:
        self._thread.start()

    def call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(START_TIMEOUT_S)

    def listen(self, server: asyncio.Server) -> int:
        self._servers.append(server)
        return int(server.sockets[0].getsockname()[1])

    def cpu_seconds(self) -> float:
        ident = self._thread.ident
        if ident is None or not self._thread.is_alive():
            return 0.0
        return time.clock_gettime(time.pthread_getcpuclockid(ident))

    def stop(self) -> None:
        if not self._thread.is_alive():
            return

        async def close() -> None:
            for s in self._servers:
                s.close()
            current = asyncio.current_task()
            for t in asyncio.all_tasks():
                if t is not current:
                    t.cancel()

        with contextlib.suppress(Exception):
            self.call(close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(START_TIMEOUT_S)
        if not self._thread.is_alive():
            self.loop.close()


class WorkerRelay:
    """On a worker, for one split replica: a TLS listener on (host, port) of the management
    network that admits only main_node's certificate (and, where pins are given, only one
    of those), in front of rpc-server on 127.0.0.1:upstream_port. port 0 takes a free one:
    start() returns it."""

    def __init__(self, tls: TLSFiles, *, host: str, upstream_port: int, main_node: str,
                 port: int = 0, pins: frozenset[str] = frozenset()) -> None:
        self.tls = tls
        self.host = host
        self.port = port
        self.upstream_port = upstream_port
        self.main_node = main_node
        self.pins = pins
        self.counters = Counters()
        self._loop = _Loop(f"rpc-relay-{main_node}")

    def start(self) -> int:
        ctx = _server_context(self.tls)
        self._loop.start()
        try:
            server = self._loop.call(asyncio.start_server(
                lambda r, w: _until_stopped(self._admit(r, w), w), self.host, self.port, ssl=ctx,
                ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S))
        except OSError as e:
            self._loop.stop()
            raise RelayError(f"the RPC relay cannot listen on {self.host}:{self.port}: {e}; "
                             "is the management address this node's, and the port free?"
                             ) from e
        self.port = self._loop.listen(server)
        return self.port

    def stop(self) -> None:
        self._loop.stop()

    def cpu_seconds(self) -> float:
        return self._loop.cpu_seconds()

    async def _admit(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        sslobj = writer.get_extra_info("ssl_object")
        der = sslobj.getpeercert(binary_form=True) if sslobj is not None else None
        # The CA was checked in the handshake (CERT_REQUIRED); the node and pin are here,
        # before anything is read from the peer or sent to rpc-server.
        why = _peer_refusal(der, None, self.main_node, self.pins)
        if why:
            self.counters.refused.append(why)
            log.warning("RPC relay refused %s: %s", peer, why)
            writer.close()
            return
        try:
            upstream = await asyncio.wait_for(
                asyncio.open_connection(LOOPBACK, self.upstream_port), CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError) as e:
            log.warning("RPC relay: rpc-server on %s:%s does not answer: %s", LOOPBACK,
                        self.upstream_port, e)
            writer.close()
            return
        _keepalive(writer)
        self.counters.carried += 1
        await _splice((reader, writer), upstream, self.counters)


class MainRelay:
    """On the main node of a split replica: one listener on 127.0.0.1 per worker, each
    connection carried over TLS to that worker's WorkerRelay, whose certificate must be the
    worker node's. start() returns the loopback ports, in the workers' order; endpoints()
    is the engine's --rpc value."""

    def __init__(self, tls: TLSFiles, workers: list[Worker]) -> None:
        self.tls = tls
        self.workers = workers
        self.ports: list[int] = []
        self.counters = Counters()
        self._loop = _Loop("rpc-relay-main")

    def start(self) -> list[int]:
        ctx, ca = _client_context(self.tls)
        self._loop.start()
        try:
            for w in self.workers:
                server = self._loop.call(asyncio.start_server(
                    functools.partial(self._carried, worker=w, ctx=ctx, ca=ca), LOOPBACK, 0))
                self.ports.append(self._loop.listen(server))
        except OSError as e:
            self._loop.stop()
            raise RelayError(f"the RPC relay cannot listen on {LOOPBACK}: {e}") from e
        return self.ports

    def endpoints(self) -> str:
        return ",".join(f"{LOOPBACK}:{p}" for p in self.ports)

    def stop(self) -> None:
        self._loop.stop()

    def cpu_seconds(self) -> float:
        return self._loop.cpu_seconds()

    async def _carried(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                       worker: Worker, ctx: ssl.SSLContext, ca: x509.Certificate) -> None:
        await _until_stopped(self._carry(reader, writer, worker=worker, ctx=ctx, ca=ca),
                             writer)

    async def _carry(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                     worker: Worker, ctx: ssl.SSLContext, ca: x509.Certificate) -> None:
        try:
            remote = await asyncio.wait_for(asyncio.open_connection(
                worker.host, worker.port, ssl=ctx, server_hostname=worker.host,
                ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S), CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError, ssl.SSLError) as e:
            log.warning("RPC relay: worker %s at %s:%s: %s", worker.node, worker.host,
                        worker.port, e)
            writer.close()
            return
        sslobj = remote[1].get_extra_info("ssl_object")
        why = _peer_refusal(sslobj.getpeercert(binary_form=True), ca, worker.node,
                            frozenset())
        if why:
            self.counters.refused.append(why)
            log.warning("RPC relay: refused worker %s at %s:%s: %s", worker.node,
                        worker.host, worker.port, why)
            remote[1].close()
            writer.close()
            return
        _keepalive(remote[1])
        self.counters.carried += 1
        await _splice((reader, writer), remote, self.counters)
