"""Two control planes on one PostgreSQL, a node and the gateway under 8 clients: the
scheduling one killed (SIGKILL), then in a second round the new scheduler frozen (SIGSTOP)
for 30 s and let go on. Every request is answered in full, the node never turns
not_ready, the other control plane schedules within 15 s, and the frozen one, woken,
writes nothing under its old epoch.

The control planes run as plain processes of this test (the host's supervised one is
stopped first), so that a kill stays a kill: supervisord would start it again at once.
Slow the first time on a machine (the node's engine is built into ~/.cache/llmgw).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from llmgw.netaddr import free_port
from tests.hosts import ThrowawayHost
from tests.loadgen import Load, until
from tests.postgres import PostgresServer

# Two minutes of 8 clients, two control planes and an engine: run on demand
# (LLMGW_FAULTS=1), not in the default suite, where the rest of the suite's load on two
# cores once starved the load's last wait (a follow-up: make it robust under load).
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    os.environ.get("LLMGW_FAULTS") != "1",
    reason="the control-plane fault rounds run on demand: LLMGW_FAULTS=1 pytest "
           "tests/test_control_plane_faults.py")]
ROUND_S = 20.0
FREEZE_S = 30.0
RESUME_GOAL_S = 15.0


@dataclass
class ControlPlaneProcess:
    """`llmgw server` on a server.yaml of its own, logging to a file."""

    config: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def settings(self) -> dict[str, Any]:
        loaded: dict[str, Any] = yaml.safe_load(self.config.read_text())
        return loaded

    @property
    def admin_url(self) -> str:
        return f"http://{self.settings['admin_listen']}"

    @property
    def log(self) -> Path:
        return self.config.with_suffix(".log")

    def start(self) -> ControlPlaneProcess:
        out = open(self.log, "ab")  # noqa: SIM115 - the process owns it
        self.proc = subprocess.Popen([sys.executable, "-m", "llmgw", "server", "--config",
                                      str(self.config)], stdout=out, stderr=subprocess.STDOUT)
        _until(f"{self.admin_url}/healthz", lambda: httpx.get(
            f"{self.admin_url}/healthz", timeout=2).status_code == 200, self.tail)
        return self

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _until(what: str, ok: Callable[[], object], log: Callable[[], str] = lambda: "",
           timeout_s: float = 120) -> None:
    until(what, ok, log, timeout_s, interval_s=0.2, catching=(Exception,))


@dataclass
class Watch:
    """Polls a control plane's admin API every 0.25 s: the worst node state seen, and who
    schedules (the lease holder and its epoch) over time."""

    token: str
    urls: list[str]
    not_ready: list[str] = field(default_factory=list)
    holders: list[tuple[float, str, int]] = field(default_factory=list)
    last: str = ""
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def __enter__(self) -> Watch:
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.thread:
            self.thread.join(10)

    def _poll(self) -> None:
        headers = {"Authorization": f"Bearer {self.token}"}
        deadline = time.monotonic() + 600
        while not self.stop.is_set() and time.monotonic() < deadline:
            for url in self.urls:  # whichever answers: one may be frozen or dead
                try:
                    got = [httpx.get(f"{url}{path}", headers=headers, timeout=5)
                           for path in ("/api/v1/nodes", "/api/v1/control-planes")]
                    if any(r.status_code != 200 for r in got):
                        self.last = f"{url}: {[r.status_code for r in got]} {got[-1].text[:200]}"
                        continue
                    nodes, planes = (r.json() for r in got)
                except (httpx.HTTPError, ValueError) as e:
                    self.last = f"{url}: {e!r}"
                    continue
                self.not_ready += [n["id"] for n in nodes if n["state"] == "not_ready"]
                for cp in planes:
                    if cp.get("scheduling"):
                        self.holders.append((time.monotonic(), cp["id"], cp["epoch"]))
                break
            time.sleep(0.25)

    def scheduler(self) -> tuple[str, int] | None:
        return self.holders[-1][1:] if self.holders else None

    def resumed_after(self, since: float, other_than: str) -> float | None:
        for at, holder, _ in self.holders:
            if at >= since and holder != other_than:
                return at - since
        return None


def _second_config(first: Path, root: Path) -> Path:
    """server.yaml for a second control plane of the same fleet on this machine: the same
    store, CA and certificates, listeners and state of its own."""
    data = yaml.safe_load(first.read_text())
    for name in ("admin_listen", "agent_listen", "gateway_listen", "gateway_metrics_listen"):
        data[name] = f"127.0.0.1:{free_port()}"
    data["state_dir"] = str(root / "cp2-state")
    data["admin_token_hash"] = str(first.with_name("admin-token.sha256"))
    path = root / "cp2.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _supervisorctl(host: ThrowawayHost, *args: str) -> None:
    subprocess.run([sys.executable, "-m", "supervisor.supervisorctl", "-c",
                    str(host.state_dir / "supervisord.conf"), *args],
                   check=True, capture_output=True, timeout=60)


@pytest.fixture
def fleet(make_host: Callable[[], ThrowawayHost], postgres_server: PostgresServer,
          served_gguf: tuple[str, str], tmp_path: Path,
          ) -> Iterator[tuple[ThrowawayHost, ControlPlaneProcess, ControlPlaneProcess]]:
    host = make_host()
    store = postgres_server.create_database()
    first = host.provision("--no-mirror", "--no-starter", f"--store={store}")
    assert first.returncode == 0, first.output[-4000:]
    url, digest = served_gguf
    with host.admin() as admin:
        admin.add_model({"name": "tiny", "source": url, "sha256": digest, "profiles": [
            {"name": "cpu", "engine": "llamacpp", "gpu_class": "", "args": ["-c", "256"]}]})
    _until("tiny to be ready", lambda: any(
        r["state"] == "ready" for r in host.admin().replicas("tiny")))
    _supervisorctl(host, "stop", "llmgw-server")
    config = host.state_dir / "etc" / "server.yaml"
    cp1 = ControlPlaneProcess(config.parent / "cp1.yaml")
    cp1.config.write_text(config.read_text())
    cp1.start()
    cp2 = ControlPlaneProcess(_second_config(config, tmp_path)).start()
    try:
        yield host, cp1, cp2
    finally:
        cp1.stop()
        cp2.stop()


def test_killing_then_freezing_the_scheduler_loses_no_request_and_no_node(fleet) -> None:
    host, cp1, cp2 = fleet
    planes = {cp.settings["admin_listen"]: cp for cp in (cp1, cp2)}
    by_id: dict[str, ControlPlaneProcess] = {}
    token = host.token
    watch = Watch(token, [cp1.admin_url, cp2.admin_url])
    gateway = f"http://127.0.0.1:{host.ports['gateway']}"
    figures: list[str] = []
    with watch, Load(gateway, key=host.gateway_key, clients=8) as load:
        _until("a scheduler", watch.scheduler)
        _until("both control planes listed", lambda: len(httpx.get(
            f"{cp1.admin_url}/api/v1/control-planes",
            headers={"Authorization": f"Bearer {token}"}).json()) >= 2)
        for cp in httpx.get(f"{cp1.admin_url}/api/v1/control-planes",
                            headers={"Authorization": f"Bearer {token}"}).json():
            listen = cp["admin_url"].removeprefix("http://")
            if listen in planes:
                by_id[cp["id"]] = planes[listen]
        learned = host.state_dir / "lib" / "llmgw-agent" / "control-planes.json"
        _until("the node to learn both control planes from its heartbeat answers",
               lambda: len(json.loads(learned.read_text())["learned"]) >= 2,
               lambda: learned.read_text() if learned.exists() else "(no file)")
        load.wait_for(20)

        # Round 1: kill -9 the scheduling control plane.
        holder, epoch = watch.scheduler()  # type: ignore[misc]
        killed = by_id[holder]
        other = cp2 if killed is cp1 else cp1
        before = (load.done, len(load.failures))
        at = time.monotonic()
        killed.signal(signal.SIGKILL)
        _until("another control plane to schedule", lambda: watch.resumed_after(at, holder),
               lambda: f"{watch.last}; {watch.holders[-3:]}; {other.tail()}", timeout_s=60)
        resumed = watch.resumed_after(at, holder)
        time.sleep(max(0.0, ROUND_S - (time.monotonic() - at)))
        figures.append(_figure("kill -9", load, before, watch, resumed))
        killed.proc.wait(10)  # type: ignore[union-attr]
        killed.start()  # it comes back as a standby: the lease is the other's

        # Round 2: freeze the new scheduler for 30 s, then let it go on.
        holder2, epoch2 = watch.scheduler()  # type: ignore[misc]
        assert holder2 != holder and epoch2 > epoch
        frozen = by_id[holder2]
        before = (load.done, len(load.failures))
        at = time.monotonic()
        frozen.signal(signal.SIGSTOP)
        try:
            _until("another control plane to schedule", lambda: watch.resumed_after(
                at, holder2), lambda: "", timeout_s=60)
            resumed = watch.resumed_after(at, holder2)
            time.sleep(max(0.0, FREEZE_S - (time.monotonic() - at)))
        finally:
            woke_at = frozen.log.stat().st_size
            frozen.signal(signal.SIGCONT)
        time.sleep(3)  # awake: it tries to schedule under its old epoch, and must not
        after_waking = frozen.log.read_bytes()[woke_at:].decode(errors="replace")
        figures.append(_figure("SIGSTOP 30 s", load, before, watch, resumed))
        load.wait_for(10)
    print("\n" + "\n".join(figures))
    assert load.failures == [], f"{len(load.failures)} of {load.done}: {load.failures[:5]}"
    assert watch.not_ready == [], f"nodes seen not_ready: {sorted(set(watch.not_ready))}"
    for line in figures:
        seconds = float(line.rsplit(" in ", 1)[1].removesuffix(" s"))
        assert seconds <= RESUME_GOAL_S, line
    # Woken, it finds the lease another's under a newer epoch and stands by: no placement
    # of its own (the scheduler's lines) and no scheduling under its old epoch.
    assert "not scheduling:" in after_waking, after_waking
    assert "llmgw.scheduler" not in after_waking, after_waking
    assert f"epoch {epoch2}, renewed" not in after_waking, after_waking
    final = watch.scheduler()
    assert final is not None and final[0] != holder2 and final[1] > epoch2, final


def _figure(what: str, load: Load, before: tuple[int, int], watch: Watch,
            resumed: float | None) -> str:
    done, failed = load.done - before[0], len(load.failures) - before[1]
    errors = sum(1 for f in load.failures[before[1]:] if "Error" in f.split(":")[0])
    return (f"{what}: {done} requests, {failed - errors} non-200, {errors} connection errors, "
            f"{len(set(watch.not_ready))} nodes not_ready, scheduling resumed in "
            f"{resumed if resumed is not None else float('nan'):.1f} s")
