"""Two real nodes on one machine through the harness: host A provisioned with its own node,
host B joined to it with `llmgw token create`'s line (issue 10's Must show).

Slow the first time on a machine (the engine is built into ~/.cache/llmgw); later runs
reuse the cached engine.
"""

from __future__ import annotations

import re
import shlex
import socket
import subprocess
import sys

import pytest

from llmgw.host import pki
from llmgw.host.layout import Layout
from tests.hosts import ThrowawayHost

NODE_ONLY = ("--no-mirror", "--no-starter")
JOIN_LINE = re.compile(r"^pytest provision/ (--join https://\S+ --token \S+ --ca-hash sha256:"
                       r"[0-9a-f]{64})$")


def token_create(host: ThrowawayHost) -> list[str]:
    """`llmgw token create --state-dir A`: its last line is the join line; its options."""
    done = subprocess.run([sys.executable, "-m", "llmgw", "token", "create", "--ttl", "10m",
                           "--state-dir", str(host.state_dir)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    line = done.stdout.strip().splitlines()[-1]
    found = JOIN_LINE.match(line)
    assert found, f"the last line is not the join line: {line!r}"
    return shlex.split(found.group(1))


@pytest.mark.slow
def test_a_second_machine_joins_with_the_token_line(make_host) -> None:
    a: ThrowawayHost = make_host()
    first = a.provision(*NODE_ONLY)
    assert first.returncode == 0, first.output

    join = token_create(a)
    b: ThrowawayHost = make_host()
    joined = b.provision("--node-name", "n2", *join)
    assert joined.returncode == 0, joined.output
    # Only the node step ran: the rest lives on A, and says so.
    for step in ("pki", "control_plane"):
        assert any("live on that machine" in line for line in joined.skips(step)), \
            joined.output
    assert any("joined https://127.0.0.1" in line and "n2" in line
               for line in joined.lines("done")), joined.steps

    with a.admin() as admin:
        nodes = {n["id"]: n for n in admin.nodes()}
    assert set(nodes) == {socket.gethostname(), "n2"}, nodes
    for n in nodes.values():
        assert n["state"] == "ready" and n["engines"] == ["llamacpp"], n

    # B holds no CA key; n2's private key exists only under B.
    a_layout = Layout.for_mode("local", a.state_dir)
    b_layout = Layout.for_mode("local", b.state_dir)
    assert not list(b.state_dir.rglob("ca-key.pem"))
    key = b_layout.agent_key.read_bytes()
    assert b_layout.agent_key.stat().st_mode & 0o777 == 0o600
    assert not [p for p in a.state_dir.rglob("*.pem") if p.read_bytes() == key]
    assert pki.common_name(pki.load_cert(b_layout.agent_cert)) == "n2"
    assert a_layout.ca_key.exists()

    # B's checks hold, read through the agent API as n2 (B has no admin API).
    checks = b.checks()
    assert checks.returncode == 0, checks.output
    assert not checks.skips("node"), checks.output

    # The same token again is refused, saying what to do.
    c: ThrowawayHost = make_host()
    again = c.provision("--node-name", "n3", *join)
    assert again.returncode != 0
    assert "the join token is used" in again.output and "llmgw token create" in again.output, \
        again.output

    # A wrong --ca-hash is refused, naming both hashes (a fresh token: the hash is checked
    # before the token is spent).
    fresh = token_create(a)
    real = fresh[fresh.index("--ca-hash") + 1]
    wrong = "sha256:" + "0" * 64
    fresh[fresh.index("--ca-hash") + 1] = wrong
    refused = c.provision("--node-name", "n3", *fresh)
    assert refused.returncode != 0
    assert real in refused.output and wrong in refused.output, refused.output
    with a.admin() as admin:
        assert "n3" not in {n["id"] for n in admin.nodes()}
