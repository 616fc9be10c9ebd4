"""The control plane's machine lost and rebuilt from `llmgw backup`: a host with a joined
node, a model and keys is backed up, its state dir destroyed, restored into a new state dir
on the same addresses, and provisioned again; the node reconnects on its own with the CA it
pinned, and a key made before the loss answers through the new gateway.

Slow the first time on a machine (the node's engine is built into ~/.cache/llmgw).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest

from tests.hosts import ThrowawayHost
from tests.loadgen import until
from tests.test_join_flow import token_create

pytestmark = pytest.mark.slow
CONTROL_ONLY = ("--no-mirror", "--no-starter", "--no-node")


def _llmgw(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmgw", *args], capture_output=True,
                          text=True, timeout=120)


def _until(what: str, ok: Callable[[], object], timeout_s: float = 180) -> None:
    until(what, ok, timeout_s=timeout_s, interval_s=1.0, catching=(Exception,))


def _ask(host: ThrowawayHost, key: str) -> str:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{host.ports['gateway']}/v1",
                           api_key=key, max_retries=0, timeout=60)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Say hi"}], max_tokens=4)
    return chat.choices[0].message.content or ""


def test_a_destroyed_control_plane_is_rebuilt_from_its_backup(
        make_host: Callable[[], ThrowawayHost], served_gguf: tuple[str, str],
        tmp_path: Path) -> None:
    a = make_host()
    first = a.provision(*CONTROL_ONLY)
    assert first.returncode == 0, first.output[-4000:]
    b = make_host()
    joined = b.provision("--node-name", "n2", "--no-mirror", "--no-starter", *token_create(a))
    assert joined.returncode == 0, joined.output[-4000:]
    url, digest = served_gguf
    with a.admin() as admin:
        admin.add_model({"name": "tiny", "source": url, "sha256": digest, "profiles": [
            {"name": "cpu", "engine": "llamacpp", "gpu_class": "", "args": ["-c", "256"]}]})
        made = admin.create_key(name="before-the-loss")
    _until("a replica of tiny on n2 to be ready", lambda: any(
        r["state"] == "ready" and r["node"] == "n2" for r in a.admin().replicas("tiny")))
    assert _ask(a, made["key"]) is not None

    passphrase = tmp_path / "passphrase"
    passphrase.write_text("a long and private passphrase\n")
    out = tmp_path / "control-plane.backup"
    done = _llmgw("backup", "--mode=local", f"--state-dir={a.state_dir}", "--out", str(out),
                  "--passphrase-file", str(passphrase))
    assert done.returncode == 0, done.stderr
    assert "2 nodes" not in done.stdout and "1 nodes, 1 models" in done.stdout, done.stdout

    # The machine is lost: its services stop and every file of its goes.
    a.down()
    shutil.rmtree(a.state_dir)
    with pytest.raises(openai.APIConnectionError):  # the negative control: nothing answers
        _ask(a, made["key"])

    rebuilt = ThrowawayHost(tmp_path / "rebuilt" / "state", ports=dict(a.ports))
    try:
        done = _llmgw("restore", str(out), "--mode=local", f"--state-dir={rebuilt.state_dir}",
                      "--passphrase-file", str(passphrase))
        assert done.returncode == 0, done.stderr
        assert "1 nodes, 1 models, 2 keys" in done.stdout, done.stdout
        again = rebuilt.provision(*CONTROL_ONLY)
        assert again.returncode == 0, again.output[-4000:]
        # What the backup held is kept, not made anew: the CA nodes pinned above all.
        ca_kept = f"pki: cluster CA in {rebuilt.state_dir / 'etc' / 'pki'}"
        assert ca_kept in again.lines("kept"), again.steps
        assert not [line for line in again.lines("done") if line.startswith("pki:")], \
            again.steps

        def n2_ready() -> bool:
            with rebuilt.admin() as admin:
                node = admin.node("n2")
            return node is not None and node["state"] == "ready" and \
                node["last_seen"] > time.time() - 10

        _until("n2 to heartbeat to the rebuilt control plane", n2_ready)
        _until("the key made before the loss to answer through the rebuilt gateway",
               lambda: _ask(rebuilt, made["key"]) is not None, timeout_s=120)
        refused = httpx.post(f"http://127.0.0.1:{rebuilt.ports['gateway']}/v1/chat/completions",
                             headers={"Authorization": "Bearer sk-llmgw-notakey0000000000"},
                             json={"model": "tiny", "messages": []}, timeout=30)
        assert refused.status_code == 401, "control: a key the fleet never made is refused"
    finally:
        rebuilt.down()
