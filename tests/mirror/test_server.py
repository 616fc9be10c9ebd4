"""`llmgw mirror serve` serves its management API on llmgw's own HTTP core: a running
mirror never imports uvicorn, the core answers what it refuses itself, an upload larger
than the core's default body limit is taken whole, and SIGTERM stops it with exit 0."""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
from pathlib import Path

from fastapi.testclient import TestClient

from llmgw.host import admin_token
from llmgw.host.netaddr import free_port
from llmgw.host.waiting import Probe, wait_until
from llmgw.http1.limits import Limits
from llmgw.mirror import MirrorClient, MirrorError
from llmgw.mirror._api import make_api
from llmgw.mirror._downloads import Manager
from tests.served import CONNECT, CORE_REFUSAL, connect_answer, imported


def test_the_management_api_runs_on_llmgws_core_and_sigterm_stops_it_cleanly(
        tmp_path: Path) -> None:
    """The process (python -X importtime) lists the API's modules, FastAPI's among them
    (the probe sees what the server imported: its control), and no uvicorn. A CONNECT is
    refused by the core in its own words; the negative control: the same request to the
    same app with no core in front (in-process) is the app's. A file over the core's
    default body limit (an upload is a whole model file) is imported."""
    token_path = tmp_path / admin_token.TOKEN_FILE
    admin_token.ensure(token_path)
    api = free_port()
    log = tmp_path / "mirror.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-X", "importtime", "-m", "llmgw", "mirror", "serve",
             "--dir", str(tmp_path / "models"), "--listen", f"127.0.0.1:{free_port()}",
             "--api-listen", f"127.0.0.1:{api}",
             "--admin-token-hash", str(admin_token.hash_path_for(token_path))],
            stdout=out, stderr=out)
    client = MirrorClient(f"http://127.0.0.1:{api}", timeout=30.0,
                          token=admin_token.read_token(token_path))
    try:
        def healthy() -> Probe:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                client.health()
            except MirrorError as e:
                return Probe(False, str(e))
            return Probe(True, "answered")

        wait_until("the mirror's API to answer /health", healthy, timeout_s=60,
                   interval_s=0.1)
        assert CORE_REFUSAL in connect_answer(api)
        big = tmp_path / "big.gguf"
        big.write_bytes(b"GGUF" + bytes(Limits().max_body_bytes + 1000))
        done = client.upload(big, model="big", version="1",
                             sha256=hashlib.sha256(big.read_bytes()).hexdigest())
        assert done["status"]["state"] == "present", done
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()[-3000:]
    finally:
        client.close()
        proc.kill()
    said = log.read_text(errors="replace")
    assert "received SIGTERM; shutting down" in said and "mirror stopped" in said
    modules = imported(log)
    assert {"fastapi", "llmgw.mirror._api", "llmgw.http1.server"} <= modules
    assert not {m for m in modules if m.split(".")[0] == "uvicorn"}

    manager = Manager(tmp_path / "in-process", "http://127.0.0.1:1")
    method, target = CONNECT.decode().split(" ")[:2]
    answer = TestClient(make_api(manager, token_hash=None)).request(method, f"http://{target}/")
    assert answer.status_code != 501 and CORE_REFUSAL.decode() not in answer.text
