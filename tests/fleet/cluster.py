"""A real control plane (`llmgw server`) and real agents (`llmgw agent`) as processes on
free loopback ports, each in its own folder: for the fleet tests and bench/heartbeats.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from llmgw.config import AgentConfig, EngineConfig, MirrorRef, ServerConfig, TLSFiles, render
from llmgw.control.client import AdminClient
from llmgw.host import admin_token, pki
from llmgw.host.netaddr import free_port
from tests.procs import cpu_s


def _start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", "llmgw", *args], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen[bytes] | None, sig: int = signal.SIGTERM) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


@dataclass
class ControlPlane:
    """`llmgw server` with its own CA (key beside it, so nodes can join) in root."""

    root: Path
    node_timeout_s: float = 30.0
    mirror_url: str = ""
    # The store's URL ("": a SQLite file in its state dir); several on one are one fleet,
    # given the same pki folder (the CA with its key, and a server certificate for loopback).
    store: str = ""
    proc: subprocess.Popen[bytes] | None = None
    gateway_proc: subprocess.Popen[bytes] | None = None
    ports: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.pki = self.root / "pki"
        self.pki.mkdir(parents=True, exist_ok=True)
        for name in ("admin", "agent", "gateway", "gateway-metrics"):
            self.ports.setdefault(name, free_port())
        if not (self.pki / "ca.pem").exists():
            ca = pki.create_ca()
            ca.write(self.pki, "ca")
            pki.issue_server(ca, ["127.0.0.1", "localhost"]).write(self.pki, "server")
        self.ca = pki.load_pair(self.pki, "ca")
        config = ServerConfig(
            admin_listen=f"127.0.0.1:{self.ports['admin']}",
            agent_listen=f"127.0.0.1:{self.ports['agent']}",
            gateway_listen=f"127.0.0.1:{self.ports['gateway']}",
            gateway_metrics_listen=f"127.0.0.1:{self.ports['gateway-metrics']}",
            state_dir=str(self.root / "state"), advertise="127.0.0.1",
            tls=TLSFiles(ca=str(self.pki / "ca.pem"), cert=str(self.pki / "server.pem"),
                         key=str(self.pki / "server-key.pem")),
            node_timeout_s=self.node_timeout_s, mirror=MirrorRef(url=self.mirror_url),
            store=self.store,
        )
        self.config = config
        (self.root / "etc").mkdir(exist_ok=True)
        # Where `llmgw token create --mode local --state-dir ROOT` looks for it.
        self.server_yaml = self.root / "etc" / "server.yaml"
        self.server_yaml.write_text(render(config, "a test control plane"))
        # The admin token beside server.yaml, where `llmgw server` finds its hash.
        self.token_path = self.root / "etc" / admin_token.TOKEN_FILE
        admin_token.ensure(self.token_path)

    def admin_client(self) -> AdminClient:
        """The admin API with the admin token."""
        return AdminClient(self.admin, token=admin_token.read_token(self.token_path))

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.ports['admin']}"

    @property
    def agent_api(self) -> str:
        return f"https://127.0.0.1:{self.ports['agent']}"

    @property
    def gateway(self) -> str:
        return f"http://127.0.0.1:{self.ports['gateway']}"

    def start(self) -> ControlPlane:
        """`llmgw server`, and `llmgw gateway` beside it (its own process, as on a host)."""
        if self.gateway_proc is None:
            self.gateway_proc = _start(["gateway", "--config", str(self.server_yaml)],
                                       self.root / "gateway.log")
        self.proc = _start(["server", "--config", str(self.server_yaml)],
                           self.root / "server.log")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llmgw server exited: {self.log()[-2000:]}")
            try:
                if httpx.get(f"{self.admin}/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"llmgw server did not answer in 30s: {self.log()[-2000:]}")

    def stop(self) -> None:
        _stop(self.proc)
        _stop(self.gateway_proc)
        self.gateway_proc = None

    def log(self) -> str:
        path = self.root / "server.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def threads(self) -> int:
        """The control plane process's thread count (from /proc)."""
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("Threads:"):
                return int(line.split()[1])
        return 0

    def cpu_s(self) -> float:
        """CPU seconds the control plane process has used (user + system)."""
        assert self.proc is not None
        return cpu_s(self.proc.pid)

    def issue(self, cn: str, directory: Path) -> TLSFiles:
        """A node identity straight from the CA (as the control plane's own node gets)."""
        directory.mkdir(parents=True, exist_ok=True)
        cert, key = pki.issue_client(self.ca, cn).write(directory, "agent")
        ca = directory / "ca.pem"
        ca.write_bytes((self.pki / "ca.pem").read_bytes())
        return TLSFiles(ca=str(ca), cert=str(cert), key=str(key))


@dataclass
class Agent:
    """`llmgw agent` for one node, its state and config in root."""

    root: Path
    node_id: str
    server: str
    tls: TLSFiles
    llama_server: str = ""
    heartbeat_s: float = 1.0
    labels: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Agent:
        config = AgentConfig(server=self.server, node_id=self.node_id,
                             state_dir=str(self.root / "state"), tls=self.tls,
                             labels=self.labels, heartbeat_s=self.heartbeat_s,
                             engine=EngineConfig(llama_server=self.llama_server))
        path = self.root / "agent.yaml"
        path.write_text(render(config, f"a test agent for {self.node_id}"))
        self.proc = _start(["agent", "--config", str(path)], self.root / "agent.log")
        return self

    def stop(self) -> None:
        _stop(self.proc)

    def engine_pids(self) -> list[int]:
        """The llama-server pids this node's agent recorded (engines outlive it)."""
        import json

        pids = []
        for record in (self.root / "state" / "replicas").glob("*.json"):
            try:
                pids.append(int(json.loads(record.read_text()).get("pid") or 0))
            except (OSError, ValueError):
                continue
        return [p for p in pids if p > 0]

    def stop_engines(self) -> None:
        for pid in self.engine_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def log(self) -> str:
        path = self.root / "agent.log"
        return path.read_text(errors="replace") if path.exists() else ""
