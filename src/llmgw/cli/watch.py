"""`llmgw check --serve ADDR`: the checks on an interval, their last result on /healthz and
/metrics (goss serve's way), and each promise's drift sent to the control plane."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from llmgw.config import parse_listen
from llmgw.contract.records import DriftFailure, DriftReport
from llmgw.host.netaddr import join_host_port
from llmgw.http1.asgi import Receive, Scope, Send
from llmgw.http1.server import Http1Server

log = logging.getLogger("llmgw.watch")

FAILED = "failed"
# A round that takes longer than this is stopped and reported as failed.
ROUND_TIMEOUT_S = 600.0

Record = dict[str, str]


@dataclass
class Result:
    """The last round's records, and since when each failing promise has failed."""

    records: list[Record] = field(default_factory=list)
    finished: float = 0.0
    duration_s: float = 0.0
    error: str = ""
    failing_since: dict[str, float] = field(default_factory=dict)

    def failed(self) -> list[Record]:
        return [r for r in self.records if r["status"] == FAILED]

    def healthy(self) -> bool:
        return bool(self.finished) and not self.error and not self.failed()


def promise_id(record: Record) -> str:
    return f"{record['step']}/{record['promise']}"


class Watch:
    """Runs rounds of checks (a callable returning records) and keeps the last result."""

    def __init__(self, run_round: Callable[[], list[Record]],
                 report: Callable[[Result], None] | None = None) -> None:
        self._run_round = run_round
        self._report = report
        self._lock = threading.Lock()
        self.result = Result()

    def round(self) -> Result:
        started = time.time()
        try:
            records, error = self._run_round(), ""
        except (OSError, ValueError, subprocess.SubprocessError) as e:
            records, error = [], f"the checks did not run: {e}"
        now = time.time()
        with self._lock:
            since = {pid: self.result.failing_since.get(pid, now)
                     for pid in map(promise_id, records) if _failed(records, pid)}
            self.result = Result(records, now, now - started, error, since)
        if self._report:
            self._report(self.result)
        return self.result

    def last(self) -> Result:
        with self._lock:
            return self.result


def _failed(records: list[Record], pid: str) -> bool:
    return any(promise_id(r) == pid and r["status"] == FAILED for r in records)


def check_round(state_dir: str | None, mode: str) -> Callable[[], list[Record]]:
    """A round: `llmgw check --json` in a child process (a fresh pytest session each time),
    its records parsed. ValueError when it printed none (it could not run at all)."""
    cmd = [sys.executable, "-m", "llmgw", "check", "--json", f"--mode={mode}",
           *([f"--state-dir={state_dir}"] if state_dir else [])]

    def run() -> list[Record]:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=ROUND_TIMEOUT_S)
        records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        if not records:
            raise ValueError(f"`{' '.join(cmd)}` exited {proc.returncode} with no record: "
                             f"{proc.stderr.strip()[-500:]}")
        return records

    return run


def healthz(result: Result) -> tuple[int, str]:
    """200 and 'ok' when every promise holds; 503 naming what failed, or why nothing ran."""
    if not result.finished:
        return 503, "no round of checks has finished yet\n"
    if result.error:
        return 503, result.error + "\n"
    failed = result.failed()
    if not failed:
        return 200, f"ok: {len(result.records)} promises checked\n"
    return 503, "".join(f"{promise_id(r)}: {_first_line(r)}\n" for r in failed)


def metrics(result: Result) -> str:
    """Prometheus text: one gauge per promise (1 holds or skipped, 0 failed), since when it
    fails, and when the last round finished."""
    lines = [
        "# HELP llmgw_promise_ok Whether the promise held in the last round (1), or failed (0).",
        "# TYPE llmgw_promise_ok gauge",
    ]
    for r in result.records:
        labels = _labels(step=r["step"], promise=promise_id(r), status=r["status"])
        lines.append(f"llmgw_promise_ok{{{labels}}} {0 if r['status'] == FAILED else 1}")
    lines += ["# HELP llmgw_promise_failing_since_seconds When the failing promise was first "
              "seen failing (unix time).", "# TYPE llmgw_promise_failing_since_seconds gauge"]
    for pid, since in sorted(result.failing_since.items()):
        lines.append(f"llmgw_promise_failing_since_seconds{{{_labels(promise=pid)}}} {since:.3f}")
    lines += ["# HELP llmgw_check_last_round_seconds When the last round finished (unix time).",
              "# TYPE llmgw_check_last_round_seconds gauge",
              f"llmgw_check_last_round_seconds {result.finished:.3f}",
              "# HELP llmgw_check_round_duration_seconds How long the last round took.",
              "# TYPE llmgw_check_round_duration_seconds gauge",
              f"llmgw_check_round_duration_seconds {result.duration_s:.3f}"]
    return "\n".join(lines) + "\n"


def _labels(**labels: str) -> str:
    def esc(v: str) -> str:
        return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return ",".join(f'{k}="{esc(v)}"' for k, v in labels.items())


def asgi_app(watch: Watch) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """/healthz and /metrics of the last round, for the HTTP core (GET and HEAD only)."""
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # no lifespan to speak
        result = watch.last()
        text = "text/plain; charset=utf-8"
        if scope["method"] not in ("GET", "HEAD"):
            code, body, kind = 405, f"{scope['method']} is not served; GET /healthz\n", text
        elif scope["path"] == "/healthz":
            (code, body), kind = healthz(result), text
        elif scope["path"] == "/metrics":
            code, body, kind = 200, metrics(result), "text/plain; version=0.0.4; charset=utf-8"
        else:
            code, body, kind = 404, "llmgw check --serve answers /healthz and /metrics\n", text
        await send({"type": "http.response.start", "status": code,
                    "headers": [(b"content-type", kind.encode())]})
        await send({"type": "http.response.body", "body": body.encode()})

    return app


def serve(addr: str, watch: Watch, interval_s: float,
          stop: threading.Event | None = None) -> None:
    """Answer /healthz and /metrics on addr while rounds run every interval_s (from the end
    of one to the start of the next) until stop is set."""
    host, port = parse_listen(addr)
    host = host or "127.0.0.1"
    server = Http1Server(asgi_app(watch), join_host_port(host, port), drain_s=1.0)
    failed: list[BaseException] = []

    def run() -> None:
        try:
            server.run()
        except BaseException as e:  # noqa: BLE001 - said below, in the caller's thread
            failed.append(e)

    serving = threading.Thread(target=run, name="check-serve", daemon=True)
    serving.start()
    while not server.started.wait(0.01):
        if failed or not serving.is_alive():
            raise OSError(f"llmgw check --serve cannot listen on {addr}: "
                          f"{failed[0] if failed else 'its server stopped'}; pick another "
                          "address (--serve HOST:PORT; when provisioning, --check-serve "
                          "HOST:PORT, or --no-check-serve to run no checks)")
    log.info("llmgw check --serve on %s: a round every %.0fs", addr, interval_s)
    stop = stop or threading.Event()
    try:
        while not stop.is_set():
            result = watch.round()
            names = ", ".join(promise_id(r) for r in result.failed())
            log.info("round: %d promises, %s (%.1fs)", len(result.records),
                     result.error or (f"failed: {names}" if names else "all hold"),
                     result.duration_s)
            stop.wait(interval_s)
    finally:
        server.should_exit = True
        serving.join(timeout=10)


def drift_report(result: Result) -> DriftReport:
    """A round as the control plane keeps it: the promises failing, since when, and why."""
    failing: list[DriftFailure] = [
        {"promise": promise_id(r), "since": result.failing_since[promise_id(r)],
         "message": _first_line(r)[:4000]} for r in result.failed()]
    if result.error:
        failing.append({"promise": "check", "since": result.finished,
                        "message": result.error[:4000]})
    return {"checked": result.finished, "promises": len(result.records), "failing": failing}


def reporter(layout: Any, host: str) -> Callable[[Result], None] | None:
    """Send each round to the control plane: through its admin API on its own machine (the
    admin token is readable there), else through the agent API as this node (a joined
    node: its certificate names it); None where this machine is neither."""
    from llmgw.config import ConfigError
    from llmgw.errors import Error
    from llmgw.host.admin_token import AdminTokenError

    if layout.server_yaml.is_file():
        send = _to_admin_api(layout, host)
    elif layout.agent_yaml.is_file():
        send = _to_agent_api(layout)
    else:
        log.info("neither %s nor %s here: this round's drift stays on /healthz and /metrics",
                 layout.server_yaml, layout.agent_yaml)
        return None

    def report(result: Result) -> None:
        try:
            send(drift_report(result))
        except (Error, ConfigError, AdminTokenError, OSError) as e:
            log.warning("could not send this round to the control plane: %s", e)

    return report


def _to_admin_api(layout: Any, host: str) -> Callable[[DriftReport], object]:
    from llmgw.cli.clients import admin_client

    def send(body: DriftReport) -> object:
        with admin_client(layout) as admin:
            return admin.report_drift(host, body)

    return send


def _to_agent_api(layout: Any) -> Callable[[DriftReport], object]:
    from llmgw.agent.client import AgentClient
    from llmgw.agent.control_planes import current_server
    from llmgw.config import load_agent

    def send(body: DriftReport) -> object:
        agent = load_agent(layout.agent_yaml)
        # The control plane the agent last reached: the one that answers its heartbeats.
        server = current_server(agent.server, agent.state_dir)
        client = AgentClient(server, agent.tls, timeout=10.0)
        try:
            return client.report_drift(body)
        finally:
            client.close()

    return send


def _first_line(record: Record) -> str:
    message = record.get("message", "").strip()
    first = message.splitlines()[0] if message else ""
    return first.removeprefix(f"{promise_id(record)}: ")


def serve_main(args: Any) -> int:
    """`llmgw check --serve ADDR [--interval S] [--name HOST]`."""
    import socket

    from llmgw.host.layout import Layout

    layout = Layout.for_mode(args.mode if not args.state_dir else "local", args.state_dir)
    name = args.name or socket.gethostname()
    watch = Watch(check_round(args.state_dir, args.mode), reporter(layout, name))
    serve(args.serve, watch, args.interval)
    return 0
