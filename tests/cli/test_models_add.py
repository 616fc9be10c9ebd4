"""`llmgw models add SOURCE` as a process, against a real mirror process, a real admin API
over a store with one node, and a loopback model hub over HTTPS with a test CA: a GGUF file
from disk or the hub is put in the mirror and added with the starter's profiles; a wrong
source, a dead hub or a file that is not GGUF is one line, with the catalog and the mirror
as they were."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmgw.contract.catalog import CATALOG_MODEL
from llmgw.control.admin_api import make_admin_app
from llmgw.host import admin_token, pki
from llmgw.host.netaddr import free_port
from llmgw.store import Store
from llmgw_harness.starter import starter_model
from tests.cli.test_day2 import write_server_yaml
from tests.mirror.conftest import MirrorProcess
from tests.servers import serve_asgi

NODE = {"engines": ["llamacpp"], "memory_mb": 16_384, "cpus": 4,
        "gpus": [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "class": "h100-80gb",
                  "uuid": "GPU-a", "memory_mb": 81_559, "memory_free_mb": 81_000,
                  "error": ""}]}
NOT_GGUF = b"<!doctype html><title>Sign in</title>" + b"x" * 4096


@dataclass
class Hub:
    """A model hub on loopback over HTTPS: GET /ORG/REPO/resolve/REV/FILE answers files[path]."""

    files: dict[str, bytes] = field(default_factory=dict)
    seen: list[str] = field(default_factory=list)
    url: str = ""

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        self.seen.append(scope["path"])
        body = self.files.get(scope["path"])
        status = 200 if body is not None else 404
        body = body if body is not None else b"not found"
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


@dataclass
class Fleet:
    state: Path
    store: Store
    mirror: MirrorProcess
    hub: Hub
    ca: Path
    tmp: Path  # the command's TMPDIR

    def llmgw(self, *args: str, hub: str | None = None, trust: bool = True
              ) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "HF_ENDPOINT": hub or self.hub.url, "TMPDIR": str(self.tmp)}
        env.pop("HF_TOKEN", None)
        if hub == "":  # none in this shell: the host's mirror.env says
            env.pop("HF_ENDPOINT")
        if trust:
            env["SSL_CERT_FILE"] = str(self.ca)
        else:
            env.pop("SSL_CERT_FILE", None)
        return subprocess.run(
            [sys.executable, "-m", "llmgw", "models", "add", *args, "--mode=local",
             f"--state-dir={self.state}"], capture_output=True, text=True, timeout=120, env=env)

    def snapshot(self) -> tuple[list[Any], list[Any], list[str]]:
        """The catalog, the mirror's versions and every path under the mirror's dir."""
        with self.mirror.client() as m:
            held = m.models()
        files = sorted(str(p.relative_to(self.mirror.dir)) for p in self.mirror.dir.rglob("*"))
        return self.store.models(), held, files


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_gguf) -> Iterator[Fleet]:
    """Module: a state dir whose server.yaml names a live admin API (a store with node-a:
    CPU and an h100-80gb card, no GPU engine) and a live `llmgw mirror serve` (its models dir
    under etc/, beside the admin token both check), and an HTTPS hub with a test CA serving
    the tiny GGUF as hf:org/repo/tiny.gguf, named by the host's etc/mirror.env too."""
    root = tmp_path_factory.mktemp("add")
    state = root / "state"
    store = Store(root / "control.db")
    store.record_heartbeat("node-a", NODE)
    ca = pki.create_ca("models add test CA")
    ca_path, _ = ca.write(root, "ca")
    cert, key = pki.issue_server(ca, ["127.0.0.1"]).write(root, "hub")
    hub = Hub({"/org/repo/resolve/main/tiny.gguf": tiny_gguf[0].read_bytes()})
    (root / "tmp").mkdir()
    hash_path = state / "etc" / admin_token.HASH_FILE
    with serve_asgi(make_admin_app(store, node_timeout_s=3600.0, token_hash=hash_path)) as url, \
            serve_asgi(hub, str(cert), str(key)) as hub_url:
        write_server_yaml(state, int(url.rsplit(":", 1)[1]))
        mirror = MirrorProcess(state / "etc" / "models", free_port(), free_port()).start()
        server_yaml = state / "etc" / "server.yaml"
        server_yaml.write_text(server_yaml.read_text() + f"mirror:\n  api: {mirror.api_url}\n"
                               f"  url: {mirror.base}\n")
        hub.url = hub_url
        (state / "etc" / "mirror.env").write_text(f'HF_ENDPOINT="{hub_url}"\n')
        try:
            yield Fleet(state, store, mirror, hub, ca_path, root / "tmp")
        finally:
            mirror.stop()


def model(fleet: Fleet, name: str) -> dict[str, Any]:
    return next(m for m in fleet.store.models() if m["name"] == name)


def assert_refused_alone(fleet: Fleet, done: subprocess.CompletedProcess[str],
                         before: tuple[Any, ...], *words: str) -> None:
    """Exit 1, one line on stderr holding words, and the catalog, the mirror (its API and
    its dir) and the command's TMPDIR as they were."""
    __tracebackhide__ = True
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    for word in words:
        assert word in done.stderr, f"{word!r} not in {done.stderr!r}"
    assert fleet.snapshot() == before, "the catalog or the mirror changed"
    assert list(fleet.tmp.iterdir()) == [], "a fetched file was left behind"


def test_a_local_gguf_is_put_in_the_mirror_and_added_with_the_starters_profiles(
        fleet, tiny_gguf) -> None:
    path, digest = tiny_gguf
    done = fleet.llmgw(str(path), "--name", "tiny-local", "--alias", "tl", "--min", "0",
                       "--max", "2")
    assert done.returncode == 0, done.stderr
    added = model(fleet, "tiny-local")
    assert added["aliases"] == ["tl"] and added["sha256"] == digest
    assert added["scaling"] == {"min": 0, "max": 2, "idle_s": 900}  # the catalog's default idle
    assert added["size_bytes"] == path.stat().st_size and added["geometry"]["block_count"] == 2
    # The starter's profiles for this fleet's GPU class, but not pinned to one machine.
    starter = CATALOG_MODEL.validate_python(
        starter_model("http://m/x.gguf", digest, ["h100-80gb"]))["profiles"]
    assert [{**p, "node_selector": {}} for p in starter] == added["profiles"]
    # Served by the mirror: its URL is the source, its bytes are the file's.
    assert added["source"].startswith(fleet.mirror.base)
    assert hashlib.sha256(httpx.get(added["source"]).content).hexdigest() == digest
    # Where it runs: the CPU profile on node-a; the GPU profile says why not.
    assert f"added tiny-local (aliases tl) from {path}" in done.stdout
    assert "min 0: no replica starts now; one would run on node-a, profile cpu" in done.stdout
    assert "profile gpu-h100-80gb: no node now: node-a's GPU engine" in done.stdout
    assert "into the mirror as tiny-local/" in done.stderr  # progress


def test_a_hub_file_is_fetched_over_https_and_added(fleet, tiny_gguf) -> None:
    """hf:ORG/REPO/FILE.gguf resolves against HF_ENDPOINT; the fetch says its progress and
    leaves nothing in TMPDIR. Control: without the test CA the same command is refused in
    one line and changes nothing (the hub is really TLS, and trusted by the CA alone)."""
    before = fleet.snapshot()
    untrusted = fleet.llmgw("hf:org/repo/tiny.gguf", "--name", "tiny-hub", trust=False)
    assert_refused_alone(fleet, untrusted, before, "a certificate this machine does not trust",
                         "CERTIFICATE_VERIFY_FAILED", "SSL_CERT_FILE")

    done = fleet.llmgw("hf:org/repo/tiny.gguf", "--name", "tiny-hub")
    assert done.returncode == 0, done.stderr
    assert fleet.hub.seen[-1] == "/org/repo/resolve/main/tiny.gguf"
    assert "fetching hf:org/repo/tiny.gguf: 100%" in done.stderr
    added = model(fleet, "tiny-hub")
    assert added["sha256"] == tiny_gguf[1] and added["source"].startswith(fleet.mirror.base)
    assert "from hf:org/repo/tiny.gguf" in done.stdout
    assert "runs on node-a, profile cpu; `llmgw status`" in done.stdout
    assert list(fleet.tmp.iterdir()) == []


def test_a_file_that_is_not_gguf_is_refused_and_nothing_is_added(fleet, tiny_gguf,
                                                                  tmp_path) -> None:
    """From the hub (an HTML page where a model should be) and from disk (the tiny GGUF with
    its magic broken): one line, catalog, mirror and TMPDIR unchanged. Control: the same
    path with a GGUF header is accepted."""
    fleet.hub.files["/org/repo/resolve/main/page.gguf"] = NOT_GGUF
    before = fleet.snapshot()
    remote = fleet.llmgw("hf:org/repo/page.gguf", "--name", "page")
    assert_refused_alone(fleet, remote, before, "is not a GGUF model file", "<!do")

    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUX" + tiny_gguf[0].read_bytes()[4:])
    local = fleet.llmgw(str(broken), "--name", "broken")
    assert_refused_alone(fleet, local, before, "is not a GGUF model file", str(broken))

    fleet.hub.files["/org/repo/resolve/main/page.gguf"] = tiny_gguf[0].read_bytes()
    accepted = fleet.llmgw("hf:org/repo/page.gguf", "--name", "page")
    assert accepted.returncode == 0, accepted.stderr
    assert "page" in [m["name"] for m in fleet.store.models()]


def test_the_hub_is_the_one_the_hosts_mirror_was_given_unless_the_shell_names_one(
        fleet) -> None:
    """With no HF_ENDPOINT in the shell, etc/mirror.env's is used (the live hub); the
    shell's own wins over it (the control: test_an_unreachable_hub_…, whose dead hub is
    the shell's while mirror.env names the live one)."""
    seen = len(fleet.hub.seen)
    done = fleet.llmgw("hf:org/repo/tiny.gguf", "--name", "tiny-env", hub="")
    assert done.returncode == 0, done.stderr
    assert fleet.hub.seen[seen:] == ["/org/repo/resolve/main/tiny.gguf"]


def test_an_unreachable_hub_is_one_line_and_nothing_is_added(fleet) -> None:
    before = fleet.snapshot()
    dead = f"https://127.0.0.1:{free_port()}"
    done = fleet.llmgw("hf:org/repo/tiny.gguf", "--name", "tiny-dead", hub=dead)
    assert_refused_alone(fleet, done, before, f"the hub at {dead} does not answer",
                         "HF_ENDPOINT")
    missing = fleet.llmgw("hf:org/repo/absent.gguf", "--name", "absent")
    assert_refused_alone(fleet, missing, before, "404", "ORG, REPO")


@pytest.mark.parametrize(("source", "says"), [
    ("hf:org/tiny.gguf", "is not hf:ORG/REPO/FILE"),
    ("hf:org/repo/README.md", "not a .gguf file"),
    ("s3://bucket/tiny.gguf", "a scheme llmgw does not fetch"),
    ("file://host/tiny.gguf", "file:///ABSOLUTE/PATH"),
    ("/nonexistent/tiny.gguf", "does not exist"),
])
def test_a_wrong_source_is_refused_before_any_network(fleet, tmp_path, source, says) -> None:
    """Refused in one line (exit 1) with no request to the hub, and even with a control
    plane that does not answer (which is exit 3 for a good source: the control)."""
    before, seen = fleet.snapshot(), len(fleet.hub.seen)
    done = fleet.llmgw(source, "--name", "wrong")
    assert_refused_alone(fleet, done, before, says)
    assert len(fleet.hub.seen) == seen, "the hub was asked"
    down = tmp_path / "down"
    write_server_yaml(down, free_port())
    cut_off = subprocess.run([sys.executable, "-m", "llmgw", "models", "add", source,
                              "--mode=local", f"--state-dir={down}"],
                             capture_output=True, text=True, timeout=60)
    assert cut_off.returncode == 1 and says in cut_off.stderr, cut_off.stderr
    good = subprocess.run([sys.executable, "-m", "llmgw", "models", "add",
                           "hf:org/repo/tiny.gguf", "--mode=local", f"--state-dir={down}"],
                          capture_output=True, text=True, timeout=60)
    assert good.returncode == 3, good.stderr


def test_a_name_taken_or_refused_by_the_catalog_changes_nothing(fleet, tiny_gguf) -> None:
    """A name already in the catalog, or options the catalog refuses (min above max), are
    said before the mirror changes. Control: test_a_local_gguf_… adds with good options."""
    fleet.store.add_model({"name": "taken", "source": "http://m/t.gguf",
                           "profiles": [{"name": "cpu", "engine": "llamacpp"}]})
    before = fleet.snapshot()
    clash = fleet.llmgw(str(tiny_gguf[0]), "--name", "taken")
    assert_refused_alone(fleet, clash, before, "taken already names a model")
    bad = fleet.llmgw(str(tiny_gguf[0]), "--name", "fine", "--min", "3", "--max", "2")
    assert_refused_alone(fleet, bad, before, "scaling.min (3) is above scaling.max (2)")


def test_idle_is_the_models_idle_time_and_a_negative_one_changes_nothing(fleet,
                                                                       tiny_gguf) -> None:
    """--idle S is the catalog's scaling.idle_s (load on demand's idle time); one the
    catalog refuses (negative) is said before the mirror changes (the control)."""
    before = fleet.snapshot()
    bad = fleet.llmgw(str(tiny_gguf[0]), "--name", "idle-bad", "--min", "0", "--idle", "-1")
    assert_refused_alone(fleet, bad, before, "idle_s")
    done = fleet.llmgw(str(tiny_gguf[0]), "--name", "idle-short", "--min", "0", "--idle", "60")
    assert done.returncode == 0, done.stderr
    assert model(fleet, "idle-short")["scaling"] == {"min": 0, "max": 1, "idle_s": 60}


def test_a_yaml_spec_still_adds_as_before_and_takes_no_file_options(fleet, tmp_path) -> None:
    spec = tmp_path / "m.yaml"
    spec.write_text("name: from-yaml\nsource: http://127.0.0.1:1/y.gguf\n"
                    "profiles: [{name: cpu, engine: llamacpp}]\n")
    before = fleet.snapshot()
    refused = fleet.llmgw(str(spec), "--name", "other")
    assert_refused_alone(fleet, refused, before, "--name apply to a model file")
    done = fleet.llmgw(str(spec))
    assert done.returncode == 0 and done.stdout == \
        "added from-yaml; `llmgw status` shows its replicas come up\n", done


def test_a_mirror_that_does_not_answer_is_said_before_anything_is_fetched(
        fleet, tmp_path) -> None:
    """The same host's admin API and token, its mirror.api a dead port: one line naming the
    mirror, no request to the hub, the catalog as it was. Control: the fleet's own state
    dir, whose mirror answers, adds (test_a_hub_file_…)."""
    state = tmp_path / "state"
    (state / "etc").mkdir(parents=True)
    server_yaml = (fleet.state / "etc" / "server.yaml").read_text()
    dead = f"http://127.0.0.1:{free_port()}"
    (state / "etc" / "server.yaml").write_text(server_yaml.replace(fleet.mirror.api_url, dead))
    for name in (admin_token.TOKEN_FILE, "mirror.env"):
        (state / "etc" / name).write_bytes((fleet.state / "etc" / name).read_bytes())
    (state / "etc" / admin_token.TOKEN_FILE).chmod(0o600)
    before, seen = fleet.store.models(), len(fleet.hub.seen)
    done = subprocess.run(
        [sys.executable, "-m", "llmgw", "models", "add", "hf:org/repo/tiny.gguf", "--name",
         "no-mirror", "--mode=local", f"--state-dir={state}"],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "SSL_CERT_FILE": str(fleet.ca), "TMPDIR": str(fleet.tmp)})
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert f"the mirror does not answer at {dead}" in done.stderr
    assert fleet.store.models() == before and len(fleet.hub.seen) == seen
