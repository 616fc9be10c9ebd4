"""`pytest provision/` makes this machine a node with llama.cpp; `pytest checks/` holds it.

Slow the first time on a machine: the engine is built (about 11 minutes on 2 cores) into
the cache under ~/.cache/llmgw, which later runs reuse.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from llmgw.control.client import ControlPlaneError
from llmgw.host.layout import Layout
from llmgw.host.services._supervisor import Supervisor
from llmgw_harness import node
from llmgw_harness._host import Host
from llmgw_harness.settings import HostSettings
from tests.hosts import ThrowawayHost

NODE_ONLY = ("--no-mirror", "--no-starter")


@pytest.mark.slow
def test_provision_brings_the_node_ready_then_keeps_it(make_host) -> None:
    host: ThrowawayHost = make_host()
    first = host.provision(*NODE_ONLY)
    assert first.returncode == 0, first.output
    node_lines = " ".join(first.lines("done") + first.lines("kept"))
    for what in ("agent certificate for", "agent.yaml", "llmgw-agent started",
                 "is ready with llamacpp"):
        assert what in node_lines, f"no line for {what}: {first.steps}"
    # The engine's progress shows as `..` lines while provision waits, or (when the cached
    # engine is ready by the fix's first look) in the `done` line's reason.
    # Or, with the cached engine and a quick first heartbeat, the node is ready at the
    # first look: kept, nothing waited for, no progress to show.
    ready_at_once = any("is ready with llamacpp" in line for line in first.lines("kept"))
    assert ready_at_once or "node          llamacpp " in first.output \
        or "(llamacpp " in node_lines, "no provisioning progress shown"

    config = yaml.safe_load((host.state_dir / "etc" / "agent.yaml").read_text())
    assert config["labels"] == {"llmgw.control-plane": "true"}
    assert config["server"] == f"https://127.0.0.1:{host.ports['agent']}"

    with host.admin() as admin:
        (node,) = admin.nodes()
    assert node["state"] == "ready" and node["engines"] == ["llamacpp"]
    assert node["labels"] == {"llmgw.control-plane": "true"}
    assert node["interface"] == "lo" and node["addr"] == "127.0.0.1"

    second = host.provision(*NODE_ONLY)
    assert second.returncode == 0, second.output
    assert "done" not in second.statuses(), second.steps
    assert any("agent.yaml (never overwritten)" in line for line in second.lines("kept"))

    checks = host.checks()
    assert checks.returncode == 0, checks.output
    assert not checks.skips("node"), checks.output


@pytest.mark.slow
def test_stopped_agent_turns_the_node_not_ready_and_checks_name_it(make_host) -> None:
    host: ThrowawayHost = make_host()
    assert host.provision(*NODE_ONLY).returncode == 0
    supervisor = Supervisor(host.state_dir)
    _shorten_timeouts(host, supervisor, heartbeat_s=1.0, node_timeout_s=4.0)
    supervisor._rpc().stopProcess("llmgw-agent")

    with host.admin() as admin:
        deadline = time.monotonic() + 30
        while admin.nodes()[0]["state"] != "not_ready":
            assert time.monotonic() < deadline, admin.nodes()
            time.sleep(0.5)

    checks = host.checks()
    assert checks.returncode != 0, checks.output
    assert "the node agent (llmgw-agent) is not running" in checks.output, checks.output
    assert "Start the node agent" in checks.output

    h = Host(HostSettings(layout=Layout.for_mode("local", host.state_dir)))
    problem = node.ready(h)
    assert problem is not None
    assert "is not_ready: no heartbeat from its agent (llmgw-agent)" in problem.found
    assert "Start the node agent" in problem.found

    supervisor._rpc().startProcess("llmgw-agent")  # and the positive control: back to ready
    assert host.checks().returncode == 0 or _ready_within(host, 30)


def _edit_yaml(path: Path, **values: float) -> None:
    config = yaml.safe_load(path.read_text())
    config.update(values)
    path.write_text(yaml.safe_dump(config, sort_keys=False))


def test_checks_skip_the_node_on_a_host_that_is_not_one(make_host) -> None:
    """provision --no-node leaves no agent.yaml; checks then skip the node, saying why."""
    host: ThrowawayHost = make_host()
    assert host.provision("--no-mirror", "--no-node", "--no-starter").returncode == 0
    checks = host.checks("-rs")
    assert checks.returncode == 0, checks.output
    assert "this machine was not made a node" in checks.output, checks.output


def _shorten_timeouts(
    host: ThrowawayHost, supervisor: Supervisor, heartbeat_s: float, node_timeout_s: float
) -> None:
    """As a person would: edit both files, restart both services."""
    _edit_yaml(host.state_dir / "etc" / "server.yaml", node_timeout_s=node_timeout_s)
    _edit_yaml(host.state_dir / "etc" / "agent.yaml", heartbeat_s=heartbeat_s)
    supervisor.restart("llmgw-server")
    supervisor.restart("llmgw-agent")
    with host.admin() as admin:
        deadline = time.monotonic() + 30
        while True:
            try:
                admin.health()
                return
            except ControlPlaneError:
                assert time.monotonic() < deadline, supervisor.describe("llmgw-server")
                time.sleep(0.2)


def _ready_within(host: ThrowawayHost, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if host.checks().returncode == 0:
            return True
        time.sleep(1)
    return False

