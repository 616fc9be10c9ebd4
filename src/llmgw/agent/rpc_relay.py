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

Both sides honour the cluster's revocation list, which the agent keeps fresh
(llmgw.agent.revocation.Revocations, given as revocations): a worker's handshake checks it
(OpenSSL's CRL check, so a removed main node's handshake fails with `certificate revoked`),
both sides check the peer's serial against it after the handshake, and a newer list that
revokes the peer of a connection already carried closes that connection.

A lost peer fails fast: TCP keepalive on every relayed connection notices a silent one
within KEEPALIVE_IDLE_S + KEEPALIVE_COUNT * KEEPALIVE_INTERVAL_S while nothing is in flight,
and TCP_USER_TIMEOUT (the same bound) ends one whose sent bytes stay unacknowledged (a
machine gone while the main engine writes to it: retransmission alone would try for
minutes). Either side closing closes the other, so the main engine sees its RPC connection
end (llama.cpp's RPC has no failover: the engine aborts at its next RPC call). The main
relay also says which worker it lost (MainRelay's on_lost), so the agent stops the engine
and reports the replica failed at once, even one that was idle.

Each carried connection has two threads, one a direction, each a blocking loop of recv_into
a buffer of its own (CHUNK) and sendall, with OpenSSL's state in memory (_TLS): a worker
holding the output layer sends the logits back, about 1 MB a token for a large vocabulary
(main_flags keeps that layer on the main node, where the placement counts it), and this costs the
kernel's copies and the cipher, not an event loop's per-chunk objects or a system call a
TLS record. TCP_NODELAY is set on every leg: the protocol
is request and response, where Nagle would hold back a command's short tail. cpu_seconds()
is the CPU time of all of one relay's threads (TLS included), which bench/split.py reports
per token.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import hashlib
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from cryptography import x509

from llmgw.agent.revocation import Revocations
from llmgw.config import TLSFiles
from llmgw.errors import Error
from llmgw.host import pki

log = logging.getLogger("llmgw.agent.rpc_relay")

LOOPBACK = "127.0.0.1"
# One read's worth (a buffer per direction of each connection): set_tensor carries whole
# weight tensors and get_tensor the logits, so large reads mean fewer system calls.
CHUNK = 256 * 1024
HANDSHAKE_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 10.0
KEEPALIVE_IDLE_S = 2
KEEPALIVE_INTERVAL_S = 1
KEEPALIVE_COUNT = 3
# How long sent bytes may stay unacknowledged before the kernel ends the connection (ms).
USER_TIMEOUT_MS = (KEEPALIVE_IDLE_S + KEEPALIVE_COUNT * KEEPALIVE_INTERVAL_S) * 1000
START_TIMEOUT_S = 10.0


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
    """What a relay saw: connections carried, peers refused (with why), bytes each way (in:
    toward rpc-server)."""

    carried: int = 0
    refused: list[str] = field(default_factory=list)
    bytes_in: int = 0
    bytes_out: int = 0
    # Round trips: bytes toward rpc-server after bytes from it (one RPC command and its
    # answer, mostly); bench/split.py reports them a token.
    exchanges: int = 0
    last_outbound: bool = False


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


def _server_context(tls: TLSFiles, crl: str | None = None) -> ssl.SSLContext:
    """The worker's side: TLS 1.3, a certificate of the cluster CA required, and where crl
    (a PEM file) is given, that certificate not on it."""
    _, prove = _load(tls, "RPC relay")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.verify_mode = ssl.CERT_REQUIRED
    # No session tickets: nothing resumes a session (each connection proves its certificate
    # anew), and nothing but the relayed bytes follows the handshake on the wire.
    ctx.num_tickets = 0
    try:
        ctx.load_verify_locations(cafile=tls.ca)
    except (OSError, ssl.SSLError) as e:
        raise RelayError(f"the RPC relay cannot load the cluster CA {tls.ca}: {e}") from e
    if crl:
        try:
            ctx.load_verify_locations(cafile=crl)
        except (OSError, ssl.SSLError) as e:
            raise RelayError(f"the RPC relay cannot load the revocation list {crl}: {e}") from e
        ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
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
                  pins: frozenset[str], revocations: Revocations | None = None) -> str:
    """Why this peer certificate may not be carried to or from; '' when it may."""
    if not der:
        return "it showed no certificate"
    cert = x509.load_der_x509_certificate(der)
    cn = pki.common_name(cert)
    if revocations is not None and revocations.revoked(cert):
        return (f"its certificate (CN {cn!r}, serial {cert.serial_number:x}) was revoked: "
                "that node was removed from the cluster")
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


def _tune(sock: socket.socket, *, keepalive: bool) -> None:
    """TCP_NODELAY on every leg (the RPC protocol is request and response: Nagle's delayed
    small writes would stall each round trip), and keepalive where asked."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if keepalive:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_COUNT)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, USER_TIMEOUT_MS)


def _cut(sock: socket.socket) -> None:
    """Ends both directions of sock at the TCP level, waking a thread blocked on it. The
    plain socket's shutdown even for a TLS one: SSLSocket.shutdown drops its TLS state, after
    which a read in another thread would return the peer's raw records."""
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


class _Threads:
    """A relay's threads (a listener each, one per connection being admitted, one per
    direction of each carried connection), the sockets they hold, and their CPU time."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.stopping = False
        self._lock = threading.Lock()
        self._live: set[threading.Thread] = set()
        self._done_cpu = 0.0
        self._socks: set[socket.socket] = set()

    def spawn(self, what: str, target: Callable[[], None]) -> None:
        def run() -> None:
            try:
                target()
            except Exception:
                log.exception("RPC relay %s: %s failed", self.name, what)
            finally:
                with self._lock:
                    self._done_cpu += time.thread_time()
                    self._live.discard(threading.current_thread())

        t = threading.Thread(target=run, name=f"{self.name}-{what}", daemon=True)
        with self._lock:
            self._live.add(t)
        t.start()

    def hold(self, sock: socket.socket) -> bool:
        """Tracks sock so stop() can end it; False (sock closed) once the relay stops."""
        with self._lock:
            if not self.stopping:
                self._socks.add(sock)
                return True
        sock.close()
        return False

    def close(self, *socks: socket.socket) -> None:
        for s in socks:
            with self._lock:
                self._socks.discard(s)
            _cut(s)
            s.close()

    def cpu_seconds(self) -> float:
        with self._lock:
            total = self._done_cpu
            for t in self._live:
                if t.ident is not None:
                    with contextlib.suppress(OSError):
                        total += time.clock_gettime(time.pthread_getcpuclockid(t.ident))
        return total

    def stop(self) -> None:
        with self._lock:
            self.stopping = True
            socks, live = list(self._socks), list(self._live)
        for s in socks:
            _cut(s)
        deadline = time.monotonic() + START_TIMEOUT_S
        for t in live:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))


def _accept_loop(threads: _Threads, listener: socket.socket,
                 handle: Callable[[socket.socket, Any], None]) -> None:
    try:
        while True:
            try:
                conn, peer = listener.accept()
            except OSError:
                if threads.stopping:
                    return
                time.sleep(0.05)  # out of descriptors, say: the next accept may do
                continue
            if threads.hold(conn):
                threads.spawn(f"conn-{peer[1]}", functools.partial(handle, conn, peer))
    finally:
        threads.close(listener)


class _TLS:
    """TLS over a blocking socket with OpenSSL's state in memory (ssl.SSLObject): a read of
    the socket takes in many records at once and a write leaves in one send, where an
    SSLSocket makes two system calls a 16 KiB record read and one a record written. The two
    directions run in two threads, so each call into OpenSSL holds a lock (none blocks:
    they only move bytes between memory buffers), and what OpenSSL writes leaves under a
    second lock, in its order."""

    def __init__(self, sock: socket.socket, ctx: ssl.SSLContext, *, server_side: bool,
                 server_hostname: str | None = None) -> None:
        self.sock = sock
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.obj = ctx.wrap_bio(self._in, self._out, server_side=server_side,
                                server_hostname=server_hostname)
        self._lock = threading.Lock()
        self._sending = threading.Lock()
        self._raw = memoryview(bytearray(CHUNK))
        self._eof = False

    def handshake(self, timeout: float) -> None:
        """The handshake, within timeout seconds; the socket's errors, ssl.SSLError, or
        TimeoutError where it did not end in time."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.obj.do_handshake()
                self._flush()
                return
            except ssl.SSLWantReadError:
                self._flush()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no TLS handshake within {timeout:.0f}s")
            self.sock.settimeout(left)
            n = self.sock.recv_into(self._raw)
            if not n:
                raise ConnectionError("the peer closed the connection in the TLS handshake")
            self._in.write(self._raw[:n])

    def peer_der(self) -> bytes | None:
        return self.obj.getpeercert(binary_form=True)

    def _flush(self) -> None:
        with self._sending:
            with self._lock:
                out = self._out.read()
            if out:
                self.sock.sendall(out)

    def recv_into(self, buf: memoryview) -> int:
        """Plain bytes into buf, as many as the records read so far hold (at least one);
        0 at the end (the peer's close_notify, or its socket's end)."""
        while not self._eof:
            got = 0
            with self._lock:
                try:
                    while got < len(buf):
                        # With a buffer, read returns the count (typeshed says bytes).
                        n = cast(int, self.obj.read(len(buf) - got, buf[got:]))
                        if not n:
                            self._eof = True
                            break
                        got += n
                except ssl.SSLWantReadError:
                    pass
                answer = self._out.pending > 0  # what reading wrote (a key update's answer)
            if answer:
                self._flush()
            if got:
                return got
            if self._eof:
                break
            took = self.sock.recv_into(self._raw)
            if not took:
                self._eof = True
                break
            with self._lock:
                self._in.write(self._raw[:took])
        return 0

    def sendall(self, data: memoryview) -> None:
        with self._sending:
            with self._lock:
                while data:
                    data = data[self.obj.write(data):]
                out = self._out.read()
            self.sock.sendall(out)


def _dial(threads: _Threads, addr: tuple[str, int], what: str) -> socket.socket | str:
    """A connection to addr, held by threads; else why not (it did not open, logged as
    what: why; or threads are closing), and the caller closes its other leg."""
    try:
        sock = socket.create_connection(addr, timeout=CONNECT_TIMEOUT_S)
    except OSError as e:
        log.warning("RPC relay: %s: %s", what, e)
        return f"it does not answer ({e})"
    if not threads.hold(sock):
        return "the relay is stopping"
    return sock


# Called with why, when the far side (b) of a spliced connection ended first.
Ended = Callable[[str], None]


def _carry(threads: _Threads, counters: Counters, raw: socket.socket, plain: socket.socket,
           a: socket.socket | _TLS, b: socket.socket | _TLS,
           b_ended: Ended | None = None) -> None:
    """A connection admitted: its TLS leg's socket (raw, kept alive) and its loopback leg
    (plain) blocking again and tuned, then a and b spliced both ways."""
    raw.settimeout(None)
    plain.settimeout(None)
    _tune(raw, keepalive=True)
    _tune(plain, keepalive=False)
    counters.carried += 1
    _splice(threads, a, b, counters, b_ended)


def _splice(threads: _Threads, a: socket.socket | _TLS, b: socket.socket | _TLS,
            counters: Counters, b_ended: Ended | None = None) -> None:
    """Bytes both ways until either side ends, one thread a direction (this one carries b
    to a); then both are closed. b_ended hears why when b's end came first (its close, or
    its socket's error) and the relay is not stopping."""
    ended = [0]
    first_end = [False]
    lock = threading.Lock()
    sa = a.sock if isinstance(a, _TLS) else a
    sb = b.sock if isinstance(b, _TLS) else b

    def pump(src: socket.socket | _TLS, dst: socket.socket | _TLS, inbound: bool) -> None:
        buf = memoryview(bytearray(CHUNK))
        # Whose end stopped this direction: src's close or error, or dst's refusing a write.
        ender, why = src, "it closed the connection"
        try:
            while n := src.recv_into(buf):
                if inbound:
                    counters.bytes_in += n
                    if counters.last_outbound:
                        counters.exchanges += 1
                        counters.last_outbound = False
                else:
                    counters.bytes_out += n
                    counters.last_outbound = True
                ender = dst
                dst.sendall(buf[:n])
                ender = src
        except OSError as e:  # ssl.SSLError included
            why = f"its connection failed: {e}"
        finally:
            with lock:
                first = not first_end[0]
                first_end[0] = True
            # Decided before cutting: the cut ends the other direction's read too.
            if first and ender is b and b_ended is not None and not threads.stopping:
                b_ended(why)
            _cut(sa)
            _cut(sb)
            with lock:
                ended[0] += 1
                last = ended[0] == 2
            if last:
                threads.close(sa, sb)

    threads.spawn("in", functools.partial(pump, a, b, True))
    pump(b, a, False)


class _Peers:
    """The connections a relay carries, by the serial of the peer's certificate: a newer
    revocation list closes those of a peer it revokes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: list[tuple[int, tuple[socket.socket, ...]]] = []

    def add(self, der: bytes | None, *socks: socket.socket) -> int:
        serial = x509.load_der_x509_certificate(der).serial_number if der else -1
        with self._lock:
            self._open = [(n, held) for n, held in self._open
                          if all(s.fileno() != -1 for s in held)]
            self._open.append((serial, socks))
        return serial

    def close_revoked(self, revoked: frozenset[int], threads: _Threads) -> list[int]:
        """Closes the connections of peers whose serial is in revoked; their serials."""
        with self._lock:
            ending = [(n, held) for n, held in self._open if n in revoked]
            self._open = [(n, held) for n, held in self._open if n not in revoked]
        for _, held in ending:
            threads.close(*held)
        return [n for n, _ in ending]


def _watch(relay: WorkerRelay | MainRelay) -> None:
    if relay.revocations is not None:
        relay.revocations.on_change(relay.revocation_changed)


def _unwatch(relay: WorkerRelay | MainRelay) -> None:
    if relay.revocations is not None:
        relay.revocations.off_change(relay.revocation_changed)


def _close_revoked(relay: WorkerRelay | MainRelay, peers: _Peers, threads: _Threads) -> None:
    assert relay.revocations is not None
    for serial in peers.close_revoked(relay.revocations.serials, threads):
        why = (f"its certificate (serial {serial:x}) was revoked while carried: that node "
               "was removed from the cluster; the connection was closed")
        relay.counters.refused.append(why)
        log.warning("RPC relay %s: %s", threads.name, why)


class WorkerRelay:
    """On a worker, for one split replica: a TLS listener on (host, port) of the management
    network that admits only main_node's certificate (and, where pins are given, only one
    of those), in front of rpc-server on 127.0.0.1:upstream_port. port 0 takes a free one:
    start() returns it. With revocations (the agent's), a revoked main node is refused in
    the handshake, and one carried when it is revoked is closed."""

    def __init__(self, tls: TLSFiles, *, host: str, upstream_port: int, main_node: str,
                 port: int = 0, pins: frozenset[str] = frozenset(),
                 revocations: Revocations | None = None) -> None:
        self.tls = tls
        self.host = host
        self.port = port
        self.upstream_port = upstream_port
        self.main_node = main_node
        self.pins = pins
        self.revocations = revocations
        self.counters = Counters()
        self._threads = _Threads(f"rpc-relay-{main_node}")
        self._ctx: ssl.SSLContext | None = None
        self._peers = _Peers()

    def _context(self) -> ssl.SSLContext:
        crl = self.revocations.crl_file() if self.revocations is not None else None
        return _server_context(self.tls, crl)

    def revocation_changed(self) -> None:
        """A newer list revoked someone: new handshakes check it, and a carried connection
        of a peer it revokes is closed."""
        try:
            self._ctx = self._context()
        except RelayError as e:
            log.warning("RPC relay %s: %s; handshakes go on with the list before it, and the "
                        "serials are checked after each", self._threads.name, e)
        _close_revoked(self, self._peers, self._threads)

    def start(self) -> int:
        self._ctx = self._context()
        _watch(self)
        try:
            listener = socket.create_server((self.host, self.port))
        except OSError as e:
            _unwatch(self)
            raise RelayError(f"the RPC relay cannot listen on {self.host}:{self.port}: {e}; "
                             "is the management address this node's, and the port free?"
                             ) from e
        self._threads.hold(listener)
        self.port = int(listener.getsockname()[1])
        self._threads.spawn("listen", functools.partial(
            _accept_loop, self._threads, listener, self._admit))
        return self.port

    def stop(self) -> None:
        _unwatch(self)
        self._threads.stop()

    def cpu_seconds(self) -> float:
        return self._threads.cpu_seconds()

    def _admit(self, raw: socket.socket, peer: Any) -> None:
        assert self._ctx is not None
        conn = _TLS(raw, self._ctx, server_side=True)
        try:
            # The CA (and, with a list held, revocation) is checked in the handshake
            # (CERT_REQUIRED); the node, pin and serial below, before anything is read from
            # the peer or sent to rpc-server.
            conn.handshake(HANDSHAKE_TIMEOUT_S)
        except OSError as e:  # ssl.SSLError and a timeout included
            self.counters.refused.append(f"its TLS handshake failed: {e}")
            log.warning("RPC relay: TLS handshake with %s failed: %s", peer, e)
            self._threads.close(raw)
            return
        why = _peer_refusal(conn.peer_der(), None, self.main_node, self.pins,
                            self.revocations)
        if why:
            self.counters.refused.append(why)
            log.warning("RPC relay refused %s: %s", peer, why)
            self._threads.close(raw)
            return
        upstream = _dial(self._threads, (LOOPBACK, self.upstream_port),
                         f"rpc-server on {LOOPBACK}:{self.upstream_port} does not answer")
        if isinstance(upstream, str):
            self._threads.close(raw)
            return
        self._peers.add(conn.peer_der(), raw, upstream)
        if self.revocations is not None:  # a list taken since the check above
            _close_revoked(self, self._peers, self._threads)
        _carry(self._threads, self.counters, raw, upstream, conn, upstream)


class MainRelay:
    """On the main node of a split replica: one listener on 127.0.0.1 per worker, each
    connection carried over TLS to that worker's WorkerRelay, whose certificate must be the
    worker node's. start() returns the loopback ports, in the workers' order; endpoints()
    is the engine's --rpc value. With revocations (the agent's), a revoked worker is
    refused, and one carried to when it is revoked is closed.

    on_lost(worker, why) hears of each worker lost while the relay runs: one that cannot be
    reached or refused (its address, its handshake, its certificate) or that ended a
    carried connection (closed it, or went silent past the keepalive). The engine's own
    close is not a loss."""

    def __init__(self, tls: TLSFiles, workers: list[Worker],
                 on_lost: Callable[[Worker, str], None] | None = None, *,
                 revocations: Revocations | None = None) -> None:
        self.tls = tls
        self.workers = workers
        self.on_lost = on_lost
        self.revocations = revocations
        self.ports: list[int] = []
        self.counters = Counters()
        self._threads = _Threads("rpc-relay-main")
        self._peers = _Peers()

    def revocation_changed(self) -> None:
        """A newer list revoked someone: a carried connection to a worker it revokes is
        closed (each new one is checked after its handshake)."""
        _close_revoked(self, self._peers, self._threads)

    def _lost(self, worker: Worker, why: str) -> None:
        if self.on_lost is not None and not self._threads.stopping:
            self.on_lost(worker, why)

    def start(self) -> list[int]:
        ctx, ca = _client_context(self.tls)
        listeners = []
        try:
            for _ in self.workers:
                listeners.append(socket.create_server((LOOPBACK, 0)))
        except OSError as e:
            for s in listeners:
                s.close()
            raise RelayError(f"the RPC relay cannot listen on {LOOPBACK}: {e}") from e
        _watch(self)
        for w, listener in zip(self.workers, listeners, strict=True):
            self._threads.hold(listener)
            self.ports.append(int(listener.getsockname()[1]))
            self._threads.spawn(f"listen-{w.node}", functools.partial(
                _accept_loop, self._threads, listener,
                functools.partial(self._carry, worker=w, ctx=ctx, ca=ca)))
        return self.ports

    def endpoints(self) -> str:
        return ",".join(f"{LOOPBACK}:{p}" for p in self.ports)

    def stop(self) -> None:
        _unwatch(self)
        self._threads.stop()

    def cpu_seconds(self) -> float:
        return self._threads.cpu_seconds()

    def _carry(self, engine: socket.socket, _peer: Any, *, worker: Worker,
               ctx: ssl.SSLContext, ca: x509.Certificate) -> None:
        where = f"worker {worker.node} at {worker.host}:{worker.port}"
        # Each loss is said before the engine's leg is closed: the engine aborts at once
        # then, and the agent should know why before it sees the engine exit.
        raw = _dial(self._threads, (worker.host, worker.port), where)
        if isinstance(raw, str):
            self._lost(worker, raw)
            self._threads.close(engine)
            return
        remote = _TLS(raw, ctx, server_side=False, server_hostname=worker.host)
        try:
            remote.handshake(HANDSHAKE_TIMEOUT_S)
        except OSError as e:  # ssl.SSLError and a timeout included
            log.warning("RPC relay: %s: %s", where, e)
            self._lost(worker, f"the TLS handshake failed: {e}")
            self._threads.close(raw, engine)
            return
        why = _peer_refusal(remote.peer_der(), ca, worker.node, frozenset(), self.revocations)
        if why:
            self.counters.refused.append(why)
            log.warning("RPC relay: refused %s: %s", where, why)
            self._lost(worker, f"refused: {why}")
            self._threads.close(raw, engine)
            return
        self._peers.add(remote.peer_der(), raw, engine)
        if self.revocations is not None:  # a list taken since the check above
            _close_revoked(self, self._peers, self._threads)
        _carry(self._threads, self.counters, raw, engine, engine, remote,
               functools.partial(self._lost, worker))
