"""A whole host as processes, without the harness: `llmgw server`, `llmgw gateway` and
`llmgw agent` on free loopback ports, with real TLS and the real llama-server, in a
local-mode state dir that the day-2 commands read (STATE/etc/server.yaml)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from llmgw.host import admin_token, pki
from llmgw.host.netaddr import free_port

TOKEN = "sk-test-token"


@dataclass
class LiveHost:
    state: Path
    llama_server: str
    heartbeat_s: float = 0.5
    ports: dict[str, int] = field(default_factory=dict)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    admin_token: str = ""

    @property
    def auth(self) -> dict[str, str]:
        """The admin API's bearer header."""
        return {"Authorization": f"Bearer {self.admin_token}"}

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.ports['admin']}"

    @property
    def gateway(self) -> str:
        return f"http://127.0.0.1:{self.ports['gateway']}"

    def start(self) -> LiveHost:
        etc = self.state / "etc"
        etc.mkdir(parents=True, exist_ok=True)
        self.ports = {name: free_port() for name in ("admin", "agent", "gateway", "metrics")}
        ca = pki.create_ca()
        ca.write(etc, "ca")
        pki.issue_server(ca, ["127.0.0.1", "localhost"]).write(etc, "server")
        pki.issue_client(ca, "node-a").write(etc, "agent")
        admin_token.ensure(etc / admin_token.TOKEN_FILE)
        self.admin_token = admin_token.read_token(etc / admin_token.TOKEN_FILE)
        tls = {"ca": str(etc / "ca.pem")}
        (etc / "server.yaml").write_text(yaml.safe_dump({
            "admin_listen": f"127.0.0.1:{self.ports['admin']}",
            "agent_listen": f"127.0.0.1:{self.ports['agent']}",
            "gateway_listen": f"127.0.0.1:{self.ports['gateway']}",
            "gateway_metrics_listen": f"127.0.0.1:{self.ports['metrics']}",
            "state_dir": str(self.state / "lib" / "llmgw"), "tokens": [TOKEN],
            "tls": {**tls, "cert": str(etc / "server.pem"), "key": str(etc / "server-key.pem")},
        }))
        (etc / "agent.yaml").write_text(yaml.safe_dump({
            "server": f"https://127.0.0.1:{self.ports['agent']}", "node_id": "node-a",
            "state_dir": str(self.state / "lib" / "llmgw-agent"), "heartbeat_s": self.heartbeat_s,
            "tls": {**tls, "cert": str(etc / "agent.pem"), "key": str(etc / "agent-key.pem")},
            "engine": {"llama_server": self.llama_server},
        }))
        for what, conf in (("server", "server"), ("gateway", "server"), ("agent", "agent")):
            log = open(self.state / f"{what}.log", "ab")  # noqa: SIM115 - the process owns it
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "llmgw", what, "--config", str(etc / f"{conf}.yaml")],
                stdout=log, stderr=subprocess.STDOUT))
        self.until("the node is ready", lambda: any(
            n["state"] == "ready" for n in self.get("/api/v1/nodes")))
        return self

    def get(self, path: str) -> Any:
        return httpx.get(self.admin + path, headers=self.auth, timeout=10).json()

    def until(self, what: str, predicate: Callable[[], bool], timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if predicate():
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                logs = {p.name: p.read_text()[-2000:] for p in self.state.glob("*.log")}
                raise AssertionError(f"timed out waiting for {what}; logs: {logs}")
            time.sleep(0.3)

    def add_model(self, spec: dict[str, Any]) -> None:
        r = httpx.post(self.admin + "/api/v1/models", json=spec, headers=self.auth, timeout=10)
        assert r.status_code == 201, r.text
        self.until(f"{spec['name']} ready", lambda: any(
            x["state"] == "ready" for x in self.get(f"/api/v1/replicas?model={spec['name']}")))

    def stop(self) -> None:
        from llmgw.agent.replicas.process import stop_engines

        for proc in reversed(self.procs):
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        stop_engines(self.state / "lib" / "llmgw-agent")
