"""`llmgw status`, `models`, `logs` and `--version` as processes against a real admin API."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from llmgw import __version__
from llmgw.control.admin_api import make_admin_app
from llmgw.host import admin_token
from llmgw.host.netaddr import free_port
from llmgw.store import Store
from tests.servers import serve_asgi

MODEL = {"name": "tiny", "aliases": ["tiny-chat"], "source": "http://m/tiny.gguf",
         "profiles": [{"name": "cpu", "engine": "llamacpp"}]}


def llmgw(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmgw", *args], capture_output=True,
                          text=True, timeout=60)


def write_server_yaml(state: Path, admin_port: int) -> None:
    (state / "etc").mkdir(parents=True, exist_ok=True)
    (state / "etc" / "server.yaml").write_text(
        yaml.safe_dump({"admin_listen": f"127.0.0.1:{admin_port}"}))
    admin_token.ensure(state / "etc" / admin_token.TOKEN_FILE)


@pytest.fixture
def host(tmp_path) -> Iterator[tuple[Path, Store]]:
    """Function: a state dir whose server.yaml names a live admin API over a fresh store."""
    store = Store(tmp_path / "control.db")
    store.record_heartbeat("node-a", {"engines": ["llamacpp"], "gpus": [], "replica_logs": {
        "r1": [f"line {i}" for i in range(100)]}})
    store.add_model(MODEL)
    store.put_replica({"id": "r1", "model": "tiny", "node": "node-a", "profile": "cpu",
                       "state": "ready", "endpoint": "http://127.0.0.1:1", "api_key": "secret"})
    hash_path = tmp_path / "state" / "etc" / admin_token.HASH_FILE
    with serve_asgi(make_admin_app(store, node_timeout_s=30.0, token_hash=hash_path)) as url:
        write_server_yaml(tmp_path / "state", int(url.rsplit(":", 1)[1]))
        yield tmp_path / "state", store


def test_version() -> None:
    done = llmgw("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"llmgw {__version__}"


def test_status_lists_nodes_and_a_ready_replica_as_a_table_and_as_json(host) -> None:
    state, _ = host
    table = llmgw("status", "--mode=local", f"--state-dir={state}")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["NODE", "STATE", "ENGINES", "GPUS", "LAST", "SEEN", "BEATS", "TO"]
    assert lines[1].split()[:3] == ["node-a", "ready", "llamacpp"]
    replica = next(line for line in lines if line.startswith("r1"))
    assert replica.split()[:4] == ["r1", "tiny", "node-a", "ready"]
    # Each model with its state (a ready replica: serving), scaling and idle time.
    model = next(line for line in lines if line.startswith("tiny "))
    assert model.split() == ["tiny", "serving", "1-1", "900", "s"]
    assert "secret" not in table.stdout
    as_json = json.loads(llmgw("status", f"--state-dir={state}", "--mode=local",
                               "--json").stdout)
    assert as_json["replicas"][0]["state"] == "ready" and as_json["nodes"][0]["id"] == "node-a"
    assert [(m["name"], m["state"]) for m in as_json["models"]] == [("tiny", "serving")]


def test_models_add_ls_rm_round_trip(host, tmp_path) -> None:
    state, store = host
    spec = tmp_path / "embed.yaml"
    spec.write_text(yaml.safe_dump({**MODEL, "name": "emb", "aliases": [],
                                    "routing_profile": "embedding"}))
    added = llmgw("models", "add", str(spec), f"--state-dir={state}", "--mode=local")
    assert added.returncode == 0 and "added emb" in added.stdout, added.stderr
    again = llmgw("models", "add", str(spec), f"--state-dir={state}", "--mode=local")
    assert again.returncode == 1 and "409" in again.stderr and "emb" in again.stderr
    listed = llmgw("models", "ls", f"--state-dir={state}", "--mode=local").stdout
    assert "tiny-chat" in listed and "embedding" in listed and "1/1" in listed
    assert llmgw("models", "rm", "emb", f"--state-dir={state}", "--mode=local").returncode == 0
    assert [m["name"] for m in store.models()] == ["tiny"]


def test_logs_prints_the_last_lines_the_node_sent(host) -> None:
    state, _ = host
    done = llmgw("logs", "r1", "-n", "3", f"--state-dir={state}", "--mode=local")
    assert done.returncode == 0 and done.stdout.splitlines() == ["line 97", "line 98", "line 99"]
    missing = llmgw("logs", "r9", f"--state-dir={state}", "--mode=local")
    assert missing.returncode == 1 and "no replica 'r9'" in missing.stderr


def test_a_control_plane_that_is_down_is_exit_3_saying_what_to_do(tmp_path) -> None:
    write_server_yaml(tmp_path, free_port())
    for cmd in (["status"], ["models", "ls"], ["logs", "r1"]):
        done = llmgw(*cmd, f"--state-dir={tmp_path}", "--mode=local")
        assert done.returncode == 3, done
        assert "does not answer" in done.stderr and "pytest provision/" in done.stderr
    nothing = llmgw("status", f"--state-dir={tmp_path / 'none'}", "--mode=local")
    assert nothing.returncode == 3 and "--state-dir" in nothing.stderr



def test_node_rm_without_a_control_plane_is_exit_3_as_its_siblings(host, tmp_path) -> None:
    """`llmgw node rm` with no server.yaml, or nothing answering at its address, exits 3
    with the words `status` and `keys` use; the control: against a live admin API it
    removes the node (0)."""
    nothing = llmgw("node", "rm", "node-a", f"--state-dir={tmp_path / 'none'}", "--mode=local")
    sibling = llmgw("keys", "ls", f"--state-dir={tmp_path / 'none'}", "--mode=local")
    assert sibling.returncode == 3, sibling
    assert nothing.returncode == 3, nothing
    assert "no control plane here" in nothing.stderr and "--state-dir" in nothing.stderr
    assert nothing.stderr.count("\n") == 1 and "Traceback" not in nothing.stderr, nothing.stderr
    down = tmp_path / "down"
    write_server_yaml(down, free_port())
    stopped = llmgw("node", "rm", "node-a", f"--state-dir={down}", "--mode=local")
    assert stopped.returncode == 3, stopped
    assert "does not answer" in stopped.stderr and "pytest provision/" in stopped.stderr
    state, store = host
    removed = llmgw("node", "rm", "node-a", f"--state-dir={state}", "--mode=local")
    assert removed.returncode == 0, removed
    assert removed.stdout.startswith("removed node-a"), removed.stdout
    assert not store.node_known("node-a")
