"""Throwaway hosts for the project's own tests: `pytest provision/` and `pytest checks/`
run for real, in subprocesses, against a temporary state dir on free loopback ports."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmgw.control.client import AdminClient
from llmgw.host.admin_token import read_token
from llmgw.host.netaddr import free_port

ROOT = Path(__file__).resolve().parent.parent
LISTENERS = ("admin", "agent", "gateway", "gateway-metrics", "mirror", "mirror-api")
# llmgw-check runs on every provisioned host (the watch step): on a free port too, and a
# round every 10 minutes, not every minute: the first round, at its start, is what tests
# read; more rounds only load the shared CPUs. A test's own --check-* options come later
# and win.
CHECK_INTERVAL_S = 600


@dataclass
class RunResult:
    returncode: int
    output: str
    steps: list[dict[str, Any]]

    def statuses(self) -> list[str]:
        return [s["status"] for s in self.steps]

    def skips(self, step: str) -> list[str]:
        """The short summary's SKIPPED lines for one step's promises: their reasons start
        with the step (`node: --no-node: ...`) or the promise (`starter/answers: needs ...`)."""
        return [line for line in self.output.splitlines()
                if line.startswith("SKIPPED") and re.search(rf"\d: {step}[:/]", line)]

    def failed(self) -> list[str]:
        """The short summary's FAILED lines (run with -rf or -ra)."""
        return [line for line in self.output.splitlines() if line.startswith("FAILED")]

    def lines(self, status: str) -> list[str]:
        return [f"{s['step']}: {s['message']}" for s in self.steps if s["status"] == status]


@dataclass
class ThrowawayHost:
    """A whole host in state_dir, listening on its own free loopback ports."""

    state_dir: Path
    ports: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in (*LISTENERS, "check"):
            self.ports.setdefault(name, free_port())

    def listen_args(self) -> list[str]:
        return [*(f"--{name}-listen=127.0.0.1:{port}" for name, port in self.ports.items()
                  if name != "check"),
                f"--check-serve=127.0.0.1:{self.ports['check']}",
                f"--check-interval={CHECK_INTERVAL_S}"]

    @property
    def check_url(self) -> str:
        """Where the host's llmgw-check answers (/healthz, /metrics)."""
        return f"http://127.0.0.1:{self.ports['check']}"

    def pytest(self, suite: str, *args: str, timeout: float = 1800,
               listen: bool = True, env: dict[str, str] | None = None) -> RunResult:
        """pytest SUITE on this host; env adds to (or, with '' values, removes from) this
        process's environment."""
        steps_json = self.state_dir.parent / f"{self.state_dir.name}-{suite.strip('/')}-steps.json"
        steps_json.unlink(missing_ok=True)
        cmd = [
            sys.executable, "-m", "pytest", suite, "-q", "-rfs", "-p", "no:randomly",
            "--mode=local", f"--state-dir={self.state_dir}", f"--steps-json={steps_json}",
            "--advertise=127.0.0.1", *(self.listen_args() if listen else ()), *args,
        ]
        environ = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", **(env or {})}
        proc = subprocess.run(
            cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
            env={k: v for k, v in environ.items() if v},
        )
        steps = json.loads(steps_json.read_text()) if steps_json.exists() else []
        return RunResult(proc.returncode, proc.stdout + proc.stderr, steps)

    def provision(self, *args: str, timeout: float = 1800,
                  env: dict[str, str] | None = None) -> RunResult:
        return self.pytest("provision/", *args, timeout=timeout, env=env)

    def checks(self, *args: str, timeout: float = 600,
               env: dict[str, str] | None = None) -> RunResult:
        """pytest checks/ with --state-dir alone: the host's files say where it listens."""
        return self.pytest("checks/", *args, timeout=timeout, listen=False, env=env)

    def down(self) -> str:
        proc = subprocess.run(
            [sys.executable, "-m", "llmgw", "down", "--mode=local",
             f"--state-dir={self.state_dir}"],
            capture_output=True, text=True, timeout=120,
        )
        return proc.stdout + proc.stderr

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['admin']}"

    @property
    def mirror_api_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['mirror-api']}"

    @property
    def token_path(self) -> Path:
        return self.state_dir / "etc" / "admin-token"

    @property
    def token(self) -> str:
        """The host's admin token, as every client of its admin and mirror APIs sends it."""
        return read_token(self.token_path)

    @property
    def auth(self) -> dict[str, str]:
        """Headers that carry the admin token, for plain httpx calls."""
        return {"Authorization": f"Bearer {self.token}"}

    @property
    def gateway_key(self) -> str:
        """The owner's gateway key provisioning made (etc/gateway-key)."""
        return (self.state_dir / "etc" / "gateway-key").read_text().strip()

    @property
    def ca_cert(self) -> Path:
        return self.state_dir / "etc" / "pki" / "ca.pem"

    def admin(self) -> AdminClient:
        return AdminClient(self.admin_url, token=self.token)
