"""A node's part in a replica split over several nodes: on a worker, rpc-server on loopback
and its TLS relay (WorkerShare); on the main node, the relays to the workers and the
engine's flags for them (MainShare). llmgw.agent.rpc_relay carries the bytes; the
replica's place is control/_split.py's."""

from __future__ import annotations

import logging
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from llmgw.agent import rpc_relay
from llmgw.agent.replicas import process, rpc_argv
from llmgw.agent.revocation import Revocations
from llmgw.agent.rpc_relay import MainRelay, RelayError, Worker, WorkerRelay
from llmgw.config import TLSFiles
from llmgw.host.netaddr import free_port

log = logging.getLogger("llmgw.agent.split")

LISTEN_WAIT_S = 30.0
STOP_GRACE_S = 10.0


# 127.0.0.1:port in LISTEN, as /proc/net/tcp writes it.
_LISTEN = "0A"


def _listening(port: int) -> bool:
    """Whether rpc-server listens on 127.0.0.1:port, read from the socket table: a probe
    connection would be one more client rpc-server serves (and logs) for nothing."""
    want = f"0100007F:{port:04X}"
    try:
        rows = Path("/proc/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return False
    return any(r.split()[1] == want and r.split()[3] == _LISTEN for r in rows)


class WorkerShare:
    """This node as a worker of a split replica: rpc-server on 127.0.0.1 (a free port of its
    own), then a relay on the management address (host) that admits main_node only.
    start() returns the relay's port, which the main node is given."""

    def __init__(self, rpc_server: Path, tls: TLSFiles, *, host: str, main_node: str,
                 profile_args: list[str], log_path: Path, relay_port: int = 0,
                 env: dict[str, str] | None = None, cards: int = 0,
                 revocations: Revocations | None = None) -> None:
        self.rpc_server = rpc_server
        # rpc-server's environment: this process's unless given (CUDA_VISIBLE_DEVICES holds
        # it to the cards placed, or to none for a CPU share).
        self.env = env
        # How many cards it serves (the CUDA build's rpc-server, named by --device): 0 on CPU.
        self.cards = cards
        self.profile_args = profile_args
        self.log_path = log_path
        self.port = free_port(rpc_relay.LOOPBACK)
        self.proc: subprocess.Popen[bytes] | None = None
        self.relay = WorkerRelay(tls, host=host, upstream_port=self.port, main_node=main_node,
                                 port=relay_port, revocations=revocations)

    def start(self) -> int:
        argv = rpc_argv.rpc_server_command(str(self.rpc_server), self.port, self.profile_args,
                                            self.cards)
        self.proc = process.spawn(argv, dict(os.environ) if self.env is None else self.env,
                                  self.log_path, log)
        deadline = time.monotonic() + LISTEN_WAIT_S
        while not _listening(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RelayError(
                    f"rpc-server did not listen on {rpc_relay.LOOPBACK}:{self.port} within "
                    f"{LISTEN_WAIT_S:.0f}s (exit {self.proc.returncode}); see {self.log_path}")
            time.sleep(0.1)
        try:
            return self.relay.start()
        except RelayError:
            self.stop()
            raise

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        self.relay.stop()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


class MainShare:
    """This node as the main node of a split replica: one loopback relay port per worker,
    and the engine's flags for them (worker_layers of the model's layers on the workers,
    shared as tensor_split says). On cards, device_layers instead: the layers of each
    device the engine sees, the workers' first and then its own cards
    (rpc_argv.gpu_main_flags)."""

    def __init__(self, tls: TLSFiles, workers: list[Worker], worker_layers: int,
                 tensor_split: str = "",
                 on_lost: Callable[[Worker, str], None] | None = None,
                 revocations: Revocations | None = None,
                 device_layers: list[int] | None = None) -> None:
        self.relay = MainRelay(tls, workers, on_lost, revocations=revocations)
        self.worker_layers = worker_layers
        self.tensor_split = tensor_split
        self.device_layers = device_layers

    def start(self) -> list[str]:
        """The relays started; the flags the main engine gets (after the profile's)."""
        self.relay.start()
        if self.device_layers:
            return rpc_argv.gpu_main_flags(self.relay.endpoints(), self.device_layers)
        flags = rpc_argv.main_flags(self.relay.endpoints(), self.worker_layers)
        if self.tensor_split and len(self.relay.workers) > 1:
            flags += ["--tensor-split", self.tensor_split]
        return flags

    def stop(self) -> None:
        self.relay.stop()
