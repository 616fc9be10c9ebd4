"""One side of the RPC relay in a process of its own, for tests that run each side in its
own network namespace (test_split_vanish.py): the worker's relay in front of an echoing
upstream, or the main's relay with one carried connection, saying when it lost its worker.

    relay_peer.py worker CA CERT KEY HOST MAIN      prints the relay's port, runs until stdin ends
    relay_peer.py main CA CERT KEY NODE HOST PORT MODE [no-user-timeout]
        prints `carried` once a round trip crossed both relays, then on `go` (stdin) idles
        (MODE idle) or writes 4 MiB toward the worker (MODE write), and prints
        `lost SECONDS WHY` when the relay says it lost the worker, or `none` after WAIT_S.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
import time

from llmgw.agent import rpc_relay
from llmgw.agent.rpc_relay import MainRelay, Worker, WorkerRelay
from llmgw.config import TLSFiles

WAIT_S = 12.0


def _echo(listener: socket.socket) -> None:
    while True:
        conn, _ = listener.accept()

        def serve(c: socket.socket = conn) -> None:
            with contextlib.suppress(OSError):
                while data := c.recv(1 << 16):
                    c.sendall(data)

        threading.Thread(target=serve, daemon=True).start()


def worker(tls: TLSFiles, host: str, main: str) -> None:
    upstream = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_echo, args=(upstream,), daemon=True).start()
    relay = WorkerRelay(tls, host=host, upstream_port=upstream.getsockname()[1],
                        main_node=main)
    print(relay.start(), flush=True)
    sys.stdin.read()


def main(tls: TLSFiles, node: str, host: str, port: int, mode: str) -> None:
    lost = threading.Event()
    said: list[str] = []

    def on_lost(w: Worker, why: str) -> None:
        said.append(why)
        lost.set()

    relay = MainRelay(tls, [Worker(node, host, port)], on_lost)
    (local,) = relay.start()
    engine = socket.create_connection(("127.0.0.1", local), timeout=10)
    engine.sendall(b"ping")
    assert engine.recv(4) == b"ping"
    print("carried", flush=True)
    assert sys.stdin.readline().strip() == "go"
    start = time.monotonic()
    if mode == "write":
        def write() -> None:
            with contextlib.suppress(OSError):
                engine.sendall(b"x" * (4 << 20))

        threading.Thread(target=write, daemon=True).start()
    if lost.wait(WAIT_S):
        print(f"lost {time.monotonic() - start:.2f} {said[0]}", flush=True)
    else:
        print("none", flush=True)


if __name__ == "__main__":
    side, ca, cert, key, *rest = sys.argv[1:]
    files = TLSFiles(ca=ca, cert=cert, key=key)
    if side == "worker":
        worker(files, rest[0], rest[1])
    else:
        if rest[4:] == ["no-user-timeout"]:
            rpc_relay.USER_TIMEOUT_MS = 0  # the kernel's default: retransmit for minutes
        main(files, rest[0], rest[1], int(rest[2]), rest[3])
