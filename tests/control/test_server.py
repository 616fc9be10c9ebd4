"""`llmgw server` serves the admin API on llmgw's own HTTP core: a running control plane
never imports uvicorn, the core answers what it refuses itself, and SIGTERM drains and
stops it with exit status 0 and its log lines."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx
import yaml

from llmgw.host import pki
from llmgw.host.netaddr import free_port
from llmgw.host.waiting import Probe, wait_until
from llmgw.store import Store
from tests.served import CONNECT, CORE_REFUSAL, connect_answer, imported
from tests.servers import admin_test_client


def _server_yaml(tmp_path: Path) -> tuple[Path, int]:
    """A server.yaml on free loopback ports with its TLS files; the admin port."""
    ca = pki.create_ca()
    ca_cert, _ = ca.write(tmp_path, "ca")
    cert, key = pki.issue_server(ca, ["127.0.0.1"]).write(tmp_path, "server")
    admin = free_port()
    path = tmp_path / "server.yaml"
    path.write_text(yaml.safe_dump({
        "admin_listen": f"127.0.0.1:{admin}", "agent_listen": f"127.0.0.1:{free_port()}",
        "gateway_metrics_listen": f"127.0.0.1:{free_port()}", "state_dir": str(tmp_path),
        "tls": {"ca": str(ca_cert), "cert": str(cert), "key": str(key)}}))
    return path, admin


def test_the_admin_api_runs_on_llmgws_core_and_sigterm_stops_it_cleanly(
        tmp_path: Path) -> None:
    """The process (python -X importtime) lists the admin API's modules, FastAPI's among
    them (the probe sees what the server imported as it started: its control), and no
    uvicorn. A CONNECT is refused by the core in its own words; the negative control:
    the same request to the same app with no core in front (in-process) is the app's."""
    config, admin = _server_yaml(tmp_path)
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "llmgw", "server",
                                 "--config", str(config)], stdout=out, stderr=out)
    try:
        def healthy() -> Probe:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                return Probe(httpx.get(f"http://127.0.0.1:{admin}/healthz",
                                       timeout=2).status_code == 200, "answered")
            except httpx.HTTPError as e:
                return Probe(False, str(e))

        wait_until("the admin API to answer /healthz", healthy, timeout_s=60, interval_s=0.1)
        assert CORE_REFUSAL in connect_answer(admin)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()[-3000:]
    finally:
        proc.kill()
    said = log.read_text(errors="replace")
    assert "received SIGTERM; shutting down" in said and "control plane stopped" in said
    modules = imported(log)
    assert {"fastapi", "llmgw.control.admin_api", "llmgw.http1.server"} <= modules
    assert not {m for m in modules if m.split(".")[0] == "uvicorn"}

    store = Store(tmp_path / "in-process.db")
    try:
        method, target = CONNECT.decode().split(" ")[:2]
        answer = admin_test_client(store, tmp_path).request(method, f"http://{target}/")
        assert answer.status_code != 501 and CORE_REFUSAL.decode() not in answer.text
    finally:
        store.close()
