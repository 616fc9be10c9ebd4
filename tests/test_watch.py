"""`llmgw check --serve`: rounds of checks, /healthz 200/503 naming what fails, a gauge per
promise on /metrics, and each host's drift at the control plane, in `llmgw status`."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx
import pytest

from llmgw.cli import watch
from llmgw.host.netaddr import free_port
from tests.hosts import ThrowawayHost


def _records(failing: str = "") -> list[dict[str, str]]:
    names = ["pki/ca", "mirror/service", "node/ready"]
    return [{"step": n.partition("/")[0], "promise": n.partition("/")[2],
             "status": "failed" if n == failing else "passed",
             "message": f"{n}: it is stopped\nmore" if n == failing else ""} for n in names]


def test_healthz_and_metrics_follow_the_rounds_and_keep_since_when() -> None:
    rounds = iter([_records(), _records("mirror/service"), _records("mirror/service")])
    w = watch.Watch(lambda: next(rounds))
    assert watch.healthz(w.last())[0] == 503  # no round yet
    assert watch.healthz(w.round()) == (200, "ok: 3 promises checked\n")
    first = w.round()
    assert watch.healthz(first) == (503, "mirror/service: it is stopped\n")
    since = first.failing_since["mirror/service"]
    time.sleep(0.01)
    second = w.round()
    assert second.failing_since == {"mirror/service": since}
    text = watch.metrics(second)
    assert text.count("llmgw_promise_ok{") == 3
    assert 'llmgw_promise_ok{step="mirror",promise="mirror/service",status="failed"} 0' in text
    assert 'llmgw_promise_ok{step="pki",promise="pki/ca",status="passed"} 1' in text
    assert f'llmgw_promise_failing_since_seconds{{promise="mirror/service"}} {since:.3f}' in text


def test_a_round_that_cannot_run_is_a_503_saying_why() -> None:
    def broken() -> list[dict[str, str]]:
        raise ValueError("`llmgw check --json` exited 4 with no record: usage")

    assert watch.healthz(watch.Watch(broken).round()) == (
        503, "the checks did not run: `llmgw check --json` exited 4 with no record: usage\n")


def test_the_server_answers_what_the_last_round_found() -> None:
    """A real HTTP server on loopback; rounds stop when told."""
    rounds = iter([_records("node/ready")] * 100)
    w, stop, port = watch.Watch(lambda: next(rounds)), threading.Event(), free_port()
    t = threading.Thread(target=watch.serve, args=(f"127.0.0.1:{port}", w, 0.05, stop))
    t.start()
    try:
        _until(lambda: httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 503)
        r = httpx.get(f"http://127.0.0.1:{port}/healthz")
        assert r.text == "node/ready: it is stopped\n"
        assert httpx.get(f"http://127.0.0.1:{port}/nope").status_code == 404
    finally:
        stop.set()
        t.join(10)


def _until(predicate, timeout_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except httpx.HTTPError as e:
            last = e
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s:.0f}s (last error: {last})")


INTERVAL_S = 2.0


@pytest.mark.slow
def test_a_provisioned_watch_sees_the_mirror_stop(make_host) -> None:
    """--check-serve runs `llmgw check --serve` under supervisord: /healthz 200; the mirror
    stopped -> 503 naming mirror/service within one interval (plus the round it takes);
    /metrics has a gauge per promise; `llmgw status` shows the drift, since when."""
    host: ThrowawayHost = make_host()
    port = free_port()
    first = host.provision("--no-node", "--no-starter", f"--check-serve=127.0.0.1:{port}",
                           f"--check-interval={INTERVAL_S:g}")
    assert first.returncode == 0, first.output[-4000:]
    url = f"http://127.0.0.1:{port}"
    _until(lambda: httpx.get(f"{url}/healthz").status_code == 200, 120)
    records = httpx.get(f"{url}/metrics").text
    assert records.count('llmgw_promise_ok{step="mirror"') == 7, records
    assert 'promise="watch/service",status="passed"} 1' in records

    round_s = float(next(line.split()[1] for line in records.splitlines()
                         if line.startswith("llmgw_check_round_duration_seconds ")))
    stopped = time.monotonic()
    subprocess.run([sys.executable, "-m", "supervisor.supervisorctl", "-c",
                    str(host.state_dir / "supervisord.conf"), "stop", "llmgw-mirror"],
                   check=True, capture_output=True, timeout=60)
    _until(lambda: httpx.get(f"{url}/healthz").status_code == 503, 120)
    # One round may have been under way when it stopped; the next one sees it.
    assert time.monotonic() - stopped <= 2 * round_s + INTERVAL_S + 5
    health = httpx.get(f"{url}/healthz").text
    assert health.startswith("mirror/service: ") and "llmgw-mirror" in health, health
    assert 'promise="mirror/service",status="failed"} 0' in httpx.get(f"{url}/metrics").text

    status = subprocess.run([sys.executable, "-m", "llmgw", "status",
                             f"--state-dir={host.state_dir}"],
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    drift = [line for line in status.stdout.splitlines() if "mirror/service" in line]
    assert drift and drift[0].split()[0] not in ("", "-"), status.stdout


def test_an_address_in_use_is_refused_at_once_naming_it() -> None:
    """The server is the HTTP core, in a thread: a bind that fails is said in the caller's
    thread (the command exits), not lost in the server's; with the port free it serves."""
    import socket

    import pytest

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    w = watch.Watch(lambda: _records())
    try:
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            watch.serve(f"127.0.0.1:{port}", w, 60.0, threading.Event())
    finally:
        busy.close()


@pytest.mark.slow
def test_no_check_serve_runs_no_checks_and_status_says_how_to_turn_them_on(make_host) -> None:
    """The negative control of the checks being on by default (tests/test_fleet_page_flow.py
    and tests/llmgw_harness/test_public_fixtures.py show a host reporting from its first
    run): with --no-check-serve no llmgw-check runs, no host reports, and `llmgw status` and
    the page say how the checks are turned on."""
    host: ThrowawayHost = make_host()
    run = host.provision("--no-mirror", "--no-node", "--no-starter", "--no-check-serve")
    assert run.returncode == 0, run.output[-4000:]
    (skip,) = run.skips("watch")
    assert "--no-check-serve: nothing keeps checking this host" in skip, skip
    assert not (host.state_dir / "etc" / "check-serve").exists()
    assert not (host.state_dir / "supervisor.d" / "llmgw-check.conf").exists()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{host.check_url}/healthz", timeout=5)
    assert httpx.get(f"{host.admin_url}/api/v1/drift", headers=host.auth).json() == []
    status = subprocess.run([sys.executable, "-m", "llmgw", "status",
                             f"--state-dir={host.state_dir}"],
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    assert ("no host reports its checks: `pytest provision/` runs them as llmgw-check "
            "(left out by --no-check-serve)") in status.stdout, status.stdout
    page = httpx.get(f"{host.admin_url}/ui/app.js").text  # drawn in a browser: the flow test
    assert '["--no-check-serve", true]' in page and '["llmgw check --serve HOST:PORT", true]' \
        in page


@pytest.mark.slow
def test_llmgw_down_stops_llmgw_check(make_host) -> None:
    """A host provisioned with its defaults runs llmgw-check (its /healthz answers); `llmgw
    down` stops it with the rest. The control: before down, it answers."""
    host: ThrowawayHost = make_host()
    run = host.provision("--no-mirror", "--no-node", "--no-starter")
    assert run.returncode == 0, run.output[-4000:]
    (done,) = [line for line in run.lines("done") if line.startswith("watch: ")]
    assert done.startswith(f"watch: llmgw-check checks every 600s and answers "
                           f"{host.check_url}/healthz (because there is no "), run.steps
    assert "watch: its /healthz answers (200 when every promise holds, else 503)" in \
        run.lines("kept"), "the start waits for it to answer"
    assert httpx.get(f"{host.check_url}/healthz", timeout=5).status_code in (200, 503)
    again = host.provision("--no-mirror", "--no-node", "--no-starter")
    assert again.returncode == 0 and "done" not in again.statuses(), again.lines("done")
    host.down()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{host.check_url}/healthz", timeout=5)
