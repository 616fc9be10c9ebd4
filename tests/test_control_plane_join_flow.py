"""Another control plane of the same fleet, as a user makes one: a first host on PostgreSQL,
`llmgw token create --control-plane` on it, and the line it prints run on a second machine
(a second state dir). The second holds the fleet's CA, admin credential and gateway key,
serves the admin API, agent API and gateway from the fleet's store, and both are listed as
control planes; a spent token and a wrong certificate key are refused, nothing written."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from collections.abc import Callable

import httpx
import pytest

from llmgw.cli import control_plane_join
from tests.hosts import ThrowawayHost
from tests.loadgen import until

pytestmark = pytest.mark.slow
CONTROL_ONLY = ("--no-mirror", "--no-starter", "--no-node")
CONTROL_PLANE_LINE = re.compile(
    r"^pytest provision/ (--join https://\S+ --token \S+ --ca-hash sha256:[0-9a-f]{64} "
    r"--control-plane --certificate-key [0-9a-f]{64})$")


def control_plane_token(host: ThrowawayHost) -> list[str]:
    """`llmgw token create --control-plane` on host: the options of the line it prints."""
    done = subprocess.run([sys.executable, "-m", "llmgw", "token", "create", "--control-plane",
                           "--ttl", "10m", "--state-dir", str(host.state_dir)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "shown only here" in done.stdout, done.stdout
    line = done.stdout.strip().splitlines()[-1]
    found = CONTROL_PLANE_LINE.match(line)
    assert found, f"the last line is not a control-plane join line: {line!r}"
    return shlex.split(found.group(1))


def _models(host: ThrowawayHost, key: str) -> int:
    return httpx.get(f"http://127.0.0.1:{host.ports['gateway']}/v1/models",
                     headers={"Authorization": f"Bearer {key}"}, timeout=30).status_code


def test_a_second_machine_becomes_a_control_plane_of_the_fleet(
        make_host: Callable[[], ThrowawayHost], postgres_url: str) -> None:
    a = make_host()
    first = a.provision(*CONTROL_ONLY, "--store", postgres_url)
    assert first.returncode == 0, first.output[-4000:]
    line = control_plane_token(a)

    b = make_host()
    joined = b.provision(*CONTROL_ONLY, *line)
    assert joined.returncode == 0, joined.output[-4000:]
    assert any(done.startswith("pki: the fleet's CA") for done in joined.lines("done")), \
        joined.steps
    # What every control plane of the fleet holds alike came over; its own certificate not.
    for name in ("pki/ca.pem", "pki/ca-key.pem", "admin-token", "gateway-key"):
        assert (b.state_dir / "etc" / name).read_bytes() == \
            (a.state_dir / "etc" / name).read_bytes(), name
    assert (b.state_dir / "etc/pki/server.pem").read_bytes() != \
        (a.state_dir / "etc/pki/server.pem").read_bytes()
    assert postgres_url in (b.state_dir / "etc/server.yaml").read_text()

    # One fleet: a key made through the first control plane answers at the second's gateway.
    with a.admin() as admin:
        made = admin.create_key(name="made-on-a")
    until("the key made on a to answer at b's gateway",
          lambda: _models(b, made["key"]) == 200, timeout_s=30, interval_s=0.5)
    assert _models(b, "sk-llmgw-notakey0000000000") == 401, "control: an unknown key"
    with b.admin() as admin:  # b's admin API, with the fleet's admin token
        planes = admin.control_planes()
    assert len(planes) == 2, planes
    assert sum(1 for p in planes if p["scheduling"]) == 1, planes

    # Again on b: every promise kept, nothing fetched twice (the token is spent).
    again = b.provision(*CONTROL_ONLY, *line)
    assert again.returncode == 0, again.output[-4000:]
    assert not again.lines("done"), again.steps


def test_a_spent_token_and_a_wrong_key_are_refused_and_nothing_is_written(
        make_host: Callable[[], ThrowawayHost], postgres_url: str) -> None:
    a = make_host()
    first = a.provision(*CONTROL_ONLY, "--store", postgres_url)
    assert first.returncode == 0, first.output[-4000:]

    line = control_plane_token(a)
    wrong = [*line[:-1], "0" * 64]
    c = make_host()
    refused = c.provision(*CONTROL_ONLY, *wrong)
    assert refused.returncode != 0
    assert "does not open the fleet's bundle" in refused.output, refused.output[-4000:]
    assert not (c.state_dir / "etc/pki/ca.pem").exists()
    assert not (c.state_dir / "etc/admin-token").exists()
    # The bundle is opened before the token is spent: the wrong key left it for the line.
    url, token, ca_hash = (line[line.index(o) + 1] for o in ("--join", "--token", "--ca-hash"))
    assert control_plane_join.fetch(url, token, ca_hash, "look", spend=False)

    # The right key, but another machine spent the token first: refused as spent.
    control_plane_join.fetch(url, token, ca_hash, "elsewhere")
    d = make_host()
    spent = d.provision(*CONTROL_ONLY, *line)
    assert spent.returncode != 0
    assert "refused the control-plane join" in spent.output, spent.output[-4000:]
    assert not (d.state_dir / "etc/pki/ca.pem").exists()
