"""Two control planes on one PostgreSQL (the second made with `llmgw token create
--control-plane` and its line), a node serving two replicas and the gateway under 8
clients: the scheduling control plane killed (SIGKILL) and one engine killed meanwhile,
then in a second round the new scheduler frozen (SIGSTOP) for 30 s and let go on. Every
request is answered in full (but those the killed engine had taken: a 502, or an error
event ending a stream, never resent),
the node never turns not_ready, the killed engine comes back, the other control plane
schedules (within 15 s: held as the bench, LLMGW_FAULTS=1), and the frozen one, woken,
writes nothing under its old epoch.

The control planes run as plain processes of this test (the hosts' supervised ones are
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

from tests.hosts import ThrowawayHost
from tests.loadgen import Load, until
from tests.postgres import PostgresServer
from tests.test_control_plane_join_flow import control_plane_token

# Two minutes of 8 clients, two control planes and two engines. The 15 s goal for
# scheduling to resume is a speed goal: held only when run as the bench
# (LLMGW_FAULTS=1 pytest -s tests/test_control_plane_faults.py), said in every run.
pytestmark = pytest.mark.slow
BENCH = os.environ.get("LLMGW_FAULTS") == "1"
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


def _supervisorctl(host: ThrowawayHost, *args: str) -> None:
    subprocess.run([sys.executable, "-m", "supervisor.supervisorctl", "-c",
                    str(host.state_dir / "supervisord.conf"), *args],
                   check=True, capture_output=True, timeout=60)


@pytest.fixture
def fleet(make_host: Callable[[], ThrowawayHost], postgres_server: PostgresServer,
          served_gguf: tuple[str, str],
          ) -> Iterator[tuple[ThrowawayHost, ControlPlaneProcess, ControlPlaneProcess]]:
    """A host on PostgreSQL with a node serving tiny (two replicas), and a second control
    plane of its fleet made as a user makes one (`llmgw token create --control-plane`, the
    line it prints provisioned on a second state dir); both then run as plain processes."""
    host = make_host()
    store = postgres_server.create_database()
    first = host.provision("--no-mirror", "--no-starter", f"--store={store}")
    assert first.returncode == 0, first.output[-4000:]
    url, digest = served_gguf
    with host.admin() as admin:
        admin.add_model({"name": "tiny", "source": url, "sha256": digest,
                         "scaling": {"min": 2, "max": 2}, "profiles": [
                             {"name": "cpu", "engine": "llamacpp", "gpu_class": "",
                              "args": ["-c", "256"]}]})
    _until("both replicas of tiny to be ready", lambda: len(_ready(host)) == 2)
    second = make_host()
    joined = second.provision("--no-mirror", "--no-starter", "--no-node",
                              *control_plane_token(host))
    assert joined.returncode == 0, joined.output[-4000:]
    for made in (host, second):
        _supervisorctl(made, "stop", "llmgw-server")
    config = host.state_dir / "etc" / "server.yaml"
    cp1 = ControlPlaneProcess(config.parent / "cp1.yaml")
    cp1.config.write_text(config.read_text())
    cp1.start()
    cp2 = ControlPlaneProcess(second.state_dir / "etc" / "server.yaml").start()
    try:
        yield host, cp1, cp2
    finally:
        cp1.stop()
        cp2.stop()


def _ready(host: ThrowawayHost) -> list[str]:
    with host.admin() as admin:
        return [r["id"] for r in admin.replicas("tiny") if r["state"] == "ready"]


def _engine_pids(host: ThrowawayHost) -> dict[str, int]:
    """The running engines of the host's node, by replica id (the agent's records)."""
    found = {}
    for path in (host.state_dir / "lib" / "llmgw-agent" / "replicas").glob("*.json"):
        record = json.loads(path.read_text())
        found[record["id"]] = int(record["pid"])
    return found


def test_killing_then_freezing_the_scheduler_loses_no_request_and_no_node(fleet) -> None:
    host, cp1, cp2 = fleet
    planes = {cp.settings["admin_listen"]: cp for cp in (cp1, cp2)}
    by_id: dict[str, ControlPlaneProcess] = {}
    token = host.token
    watch = Watch(token, [cp1.admin_url, cp2.admin_url])
    gateway = f"http://127.0.0.1:{host.ports['gateway']}"
    figures: list[str] = []
    # The load outlasts both rounds and the waits between them, on a loaded machine too
    # (with loadgen's 60 s bound it ran out before the last wait: the CI failure).
    with watch, Load(gateway, key=host.gateway_key, clients=8, per_client=20_000,
                     limit_s=300) as load:
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
        # Meanwhile one of tiny's two engines is killed too: its agent starts it again with
        # no control plane's help, and the gateway routes around it until it is ready.
        victim, pid = sorted(_engine_pids(host).items())[0]
        os.kill(pid, signal.SIGKILL)
        engine_killed = time.monotonic()
        _until("the killed replica to be ready again",
               lambda: _engine_pids(host)[victim] != pid and victim in _ready_at(other, token),
               lambda: f"{_ready_at(other, token)}", timeout_s=60)
        back = time.monotonic() - engine_killed
        _until("another control plane to schedule", lambda: watch.resumed_after(at, holder),
               lambda: f"{watch.last}; {watch.holders[-3:]}; {other.tail()}", timeout_s=60)
        resumed = watch.resumed_after(at, holder)
        time.sleep(max(0.0, ROUND_S - (time.monotonic() - at)))
        cut = [f for f in load.failures[before[1]:] if "failed while answering" in f]
        figures.append(_figure("kill -9", load, before, watch, resumed, cut) +
                       f"; a replica killed meanwhile ready again in {back:.1f} s")
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
        # Awake, it goes on with the step it was in: it must find the lease another's.
        def after_waking() -> str:
            return frozen.log.read_bytes()[woke_at:].decode(errors="replace")

        _until("the woken control plane to say it does not schedule",
               lambda: "not scheduling:" in after_waking(), after_waking, timeout_s=60)
        time.sleep(2)  # and a tick or two more, in which it must write nothing
        figures.append(_figure("SIGSTOP 30 s", load, before, watch, resumed))
        load.wait_for(10)
    print("\n" + "\n".join(figures))
    # Only requests the killed engine had taken may fail (at most one per client).
    lost = [f for f in load.failures if "failed while answering" not in f]
    assert lost == [], f"{len(lost)} of {load.done}: {lost[:5]}"
    assert len(load.failures) <= 8, load.failures
    assert watch.not_ready == [], f"nodes seen not_ready: {sorted(set(watch.not_ready))}"
    if BENCH:
        for line in figures:
            seconds = float(line.split("scheduling resumed in ", 1)[1].split(" s", 1)[0])
            assert seconds <= RESUME_GOAL_S, line
    # Woken, it finds the lease another's under a newer epoch and stands by: no placement
    # of its own (the scheduler's lines) and no scheduling under its old epoch.
    woken = after_waking()
    assert "llmgw.scheduler" not in woken, woken
    assert f"epoch {epoch2}, renewed" not in woken, woken
    final = watch.scheduler()
    assert final is not None and final[0] != holder2 and final[1] > epoch2, final


def _ready_at(cp: ControlPlaneProcess, token: str) -> list[str]:
    """The ready replicas of tiny, as the control plane cp sees them."""
    got = httpx.get(f"{cp.admin_url}/api/v1/replicas", headers={
        "Authorization": f"Bearer {token}"}, params={"model": "tiny"}, timeout=5)
    return [r["id"] for r in got.json() if r["state"] == "ready"]


def _figure(what: str, load: Load, before: tuple[int, int], watch: Watch,
            resumed: float | None, cut: list[str] | None = None) -> str:
    """One round's line; cut: requests a killed engine took and could not finish (502,
    never resent elsewhere, so a generation never runs twice), said apart."""
    done = load.done - before[0]
    failed = [f for f in load.failures[before[1]:] if f not in (cut or [])]
    errors = sum(1 for f in failed if "Error" in f.split(":")[0])
    line = (f"{what}: {done} requests, {len(failed) - errors} non-200, {errors} connection "
            f"errors, {len(set(watch.not_ready))} nodes not_ready, scheduling resumed in "
            f"{resumed if resumed is not None else float('nan'):.1f} s")
    return line + (f" ({len(cut)} cut in flight by the engine's kill)" if cut else "")
