"""System mode for real: a booted systemd, root, a clone under /root, `scripts/up`.

The tests run in order on one host (the session's container) and each leaves it serving.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.loadgen import Load
from tests.system.container import SystemdContainer
from tests.tiny_gguf import write_tiny_gguf

pytestmark = pytest.mark.slow

CLONE = "/root/llmgw"
MODEL = "/srv/llmgw-test/tiny.gguf"
UNITS = ("llmgw-server", "llmgw-gateway", "llmgw-mirror", "llmgw-agent", "llmgw-check")
STARTER = "llmgw-tiny-test"  # the tiny GGUF's general.name
UP_TIMEOUT_S = 1800
# What provisioning writes; `pytest checks/` must leave every byte of it as it was.
WRITTEN = ("/etc/llmgw", "/etc/systemd/system", "/opt/llmgw/current/llmgw-install.json")


# The first run is given the hub's address and a token, as a user with a gated model
# would; the starter comes from a file, so the hub is never asked.
HUB_ENV = {"HF_TOKEN": "hf_system_test_token", "HF_ENDPOINT": "http://127.0.0.1:9"}


def up(c: SystemdContainer, steps_json: str, cwd: str = CLONE,
       env: dict[str, str] | None = None) -> tuple[Any, list[dict]]:
    proc = c.run("bash", "scripts/up", "--advertise", "127.0.0.1", "--starter-source",
                 f"file://{MODEL}", f"--steps-json={steps_json}", cwd=cwd, check=False,
                 timeout=UP_TIMEOUT_S, env=env)
    steps_file = c.path(steps_json)
    steps = json.loads(steps_file.read_text()) if steps_file.exists() else []
    return proc, steps


def checks(c: SystemdContainer) -> Any:
    return c.run(".venv/bin/python", "-m", "pytest", "checks/", "-q", "-p", "no:randomly",
                 cwd=CLONE, check=False, timeout=600)


def main_pid(c: SystemdContainer, unit: str) -> str:
    return c.show(unit, "MainPID")["MainPID"]


def replicas(c: SystemdContainer) -> list[dict]:
    token = c.path("/etc/llmgw/admin-token").read_text().strip()
    r = httpx.get(f"http://127.0.0.1:9090/api/v1/replicas?model={STARTER}", timeout=10,
                  headers={"Authorization": f"Bearer {token}"})
    r.raise_for_status()
    return [x for x in r.json() if x["state"] != "stopped"]


def engine_pids(c: SystemdContainer) -> dict[str, int]:
    """Replica id → engine pid, from the agent's records."""
    found = {}
    for path in c.path("/var/lib/llmgw-agent/replicas").glob("*.json"):
        record = json.loads(path.read_text())
        found[record["id"]] = record["pid"]
    return found


def owner_key(c: SystemdContainer) -> str:
    """The owner's gateway key, which provisioning made."""
    return c.path("/etc/llmgw/gateway-key").read_text().strip()


def ask(c: SystemdContainer, timeout_s: float = 120) -> str:
    """One chat completion with the owner's gateway key."""
    body = {"model": "qwen-0.5b", "max_tokens": 8,
            "messages": [{"role": "user", "content": "hello"}]}
    key = owner_key(c)
    r = httpx.post("http://127.0.0.1:8080/v1/chat/completions", json=body, timeout=timeout_s,
                   headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


def wait_for(what: str, ok: Any, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = ok()
            if last:
                return
        except (httpx.HTTPError, AssertionError) as e:
            last = e
        time.sleep(1)
    raise AssertionError(f"gave up waiting for {what} after {timeout_s:.0f}s; last: {last}")


def snapshot(c: SystemdContainer) -> dict[str, str]:
    """path → sha256 of every file provisioning writes."""
    out = {}
    for top in WRITTEN:
        root = c.path(top)
        for p in sorted([root] if root.is_file() else root.rglob("*")):
            if p.is_file():
                out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.fixture(scope="module")
def host(systemd_container: SystemdContainer) -> Iterator[SystemdContainer]:
    """Module: the container with the tiny model under /srv, provisioned by `scripts/up`."""
    c = systemd_container
    model = c.path(MODEL)
    write_tiny_gguf(model)
    model.chmod(0o644)
    model.parent.chmod(0o755)
    began = time.monotonic()
    proc, steps = up(c, "/root/up-1.json", env=HUB_ENV)
    c.first_up = (proc, steps, time.monotonic() - began)  # type: ignore[attr-defined]
    yield c


def test_scripts_up_brings_a_whole_host_up(host: SystemdContainer) -> None:
    """`bash scripts/up --advertise 127.0.0.1 --starter-source file://…` exits 0 as root
    from a clone under /root, and installs llmgw into /opt/llmgw on the way."""
    proc, steps, took = host.first_up  # type: ignore[attr-defined]
    print(f"boot {host.boot_s:.1f}s; first scripts/up {took:.0f}s")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    installed = [s["message"] for s in steps if s["step"] == "install"]
    assert installed and installed[0].startswith("llmgw ") and "installed in /opt/llmgw" \
        in installed[0], steps


def test_the_three_units_run_the_installed_llmgw(host: SystemdContainer) -> None:
    """Active, ExecStart /usr/local/bin/llmgw (into /opt/llmgw), nothing under a home."""
    for unit in UNITS:
        props = host.show(unit, "ActiveState", "SubState", "ExecStart")
        assert (props["ActiveState"], props["SubState"]) == ("active", "running"), (unit, props)
        assert "path=/usr/local/bin/llmgw " in props["ExecStart"], (unit, props)
        assert "/root/" not in props["ExecStart"] and "/home/" not in props["ExecStart"], props
    target = host.run("readlink", "-f", "/usr/local/bin/llmgw").stdout.strip()
    assert target.startswith("/opt/llmgw/releases/0.1.0-"), target
    python = host.run("readlink", "-f", "/opt/llmgw/current/bin/python").stdout.strip()
    assert not python.startswith(("/root/", "/home/")), python


def test_the_mirror_runs_as_llmgw_hardened(host: SystemdContainer) -> None:
    props = host.show("llmgw-mirror", "User", "NoNewPrivileges", "ProtectSystem",
                      "ProtectHome", "PrivateTmp", "ReadWritePaths", "MainPID")
    assert props["User"] == "llmgw", props
    assert (props["NoNewPrivileges"], props["ProtectSystem"], props["ProtectHome"],
            props["PrivateTmp"]) == ("yes", "strict", "yes", "yes"), props
    assert props["ReadWritePaths"] == "/srv/models", props
    user = host.run("ps", "-o", "user=", "-p", props["MainPID"]).stdout.strip()
    assert user == "llmgw", user


def test_the_control_plane_runs_as_llmgw_hardened(host: SystemdContainer) -> None:
    props = host.show("llmgw-server", "User", "NoNewPrivileges", "ProtectSystem",
                      "ProtectHome", "StateDirectory", "MainPID")
    assert (props["User"], props["NoNewPrivileges"], props["ProtectSystem"],
            props["ProtectHome"], props["StateDirectory"]) == (
        "llmgw", "yes", "strict", "yes", "llmgw"), props
    user = host.run("ps", "-o", "user=", "-p", props["MainPID"]).stdout.strip()
    assert user == "llmgw", user
    ca_key = host.run("stat", "-c", "%U %a", "/etc/llmgw/pki/ca-key.pem").stdout.split()
    assert ca_key == ["llmgw", "600"], ca_key  # it signs joining nodes' certificates


def test_the_hub_token_reaches_the_mirror_through_a_root_only_file(host: SystemdContainer) -> None:
    """Never through the unit text, which every user can read."""
    env_file = host.run("stat", "-c", "%U %a", "/etc/llmgw/mirror.env").stdout.split()
    assert env_file == ["root", "600"], env_file
    unit = host.run("systemctl", "cat", "llmgw-mirror").stdout
    assert HUB_ENV["HF_TOKEN"] not in unit and "EnvironmentFile=-/etc/llmgw/mirror.env" in unit
    pid = main_pid(host, "llmgw-mirror")
    environ = host.path(f"/proc/{pid}/environ")
    seen = host.run("cat", f"/proc/{pid}/environ").stdout.split("\0")
    assert f"HF_TOKEN={HUB_ENV['HF_TOKEN']}" in seen, environ


def test_the_agent_unit_keeps_engines_and_unlocks_memory(host: SystemdContainer) -> None:
    props = host.show("llmgw-agent", "KillMode", "LimitMEMLOCK")
    assert props == {"KillMode": "process", "LimitMEMLOCK": "infinity"}, props


def test_restarting_the_agent_keeps_the_engine(host: SystemdContainer) -> None:
    """`systemctl restart llmgw-agent`: same engine pid, and the replica stays ready."""
    before = engine_pids(host)
    assert before, "the agent has recorded no engine"
    host.run("systemctl", "restart", "llmgw-agent")
    time.sleep(5)  # past a heartbeat or two of the new agent
    wait_for("the replica to be ready", lambda: any(r["state"] == "ready"
                                                     for r in replicas(host)))
    assert engine_pids(host) == before
    for pid in before.values():
        assert host.run("kill", "-0", str(pid), check=False).returncode == 0, pid


def test_a_second_run_changes_nothing(host: SystemdContainer) -> None:
    proc, steps = up(host, "/root/up-2.json")
    assert proc.returncode == 0, proc.stdout[-6000:]
    done = [s for s in steps if s["status"] == "done"]
    assert not done, done


def test_checks_pass_and_change_nothing(host: SystemdContainer) -> None:
    files, pids = snapshot(host), {u: main_pid(host, u) for u in UNITS}
    proc = checks(host)
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert snapshot(host) == files
    assert {u: main_pid(host, u) for u in UNITS} == pids


def test_checks_name_a_stopped_mirror(host: SystemdContainer) -> None:
    """Negative control: with llmgw-mirror stopped, checks fail and say so."""
    host.run("systemctl", "stop", "llmgw-mirror")
    try:
        proc = checks(host)
    finally:
        host.run("systemctl", "start", "llmgw-mirror")
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert "llmgw-mirror" in proc.stdout and "inactive" in proc.stdout, proc.stdout[-6000:]


def test_a_disabled_unit_fails_the_checks_and_provision_enables_it(
        host: SystemdContainer) -> None:
    """A unit disabled while it runs stays down after a reboot: it used to be `kept`. The
    Go original runs `enable --now` every time; provision does when the probe finds it."""
    host.run("systemctl", "disable", "llmgw-mirror")
    proc = checks(host)
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert "llmgw-mirror is disabled under systemd" in proc.stdout, proc.stdout[-6000:]
    again, steps = up(host, "/root/up-enable.json")
    assert again.returncode == 0, again.stdout[-6000:]
    assert host.run("systemctl", "is-enabled", "llmgw-mirror").stdout.strip() == "enabled"
    done = [s for s in steps if s["status"] == "done"]
    assert [s["promise"] for s in done] == ["mirror/service"], done


def test_the_gateway_runs_as_llmgw_hardened_on_a_socket_systemd_holds(
        host: SystemdContainer) -> None:
    props = host.show("llmgw-gateway", "User", "NoNewPrivileges", "ProtectSystem",
                      "ProtectHome", "StateDirectory", "KillMode", "MainPID")
    assert (props["User"], props["NoNewPrivileges"], props["ProtectSystem"],
            props["ProtectHome"], props["StateDirectory"], props["KillMode"]) == (
        "llmgw", "yes", "strict", "yes", "llmgw", "mixed"), props
    user = host.run("ps", "-o", "user=", "-p", props["MainPID"]).stdout.strip()
    assert user == "llmgw", user
    socket = host.show("llmgw-gateway.socket", "ActiveState", "Listen")
    assert socket["ActiveState"] == "active" and "0.0.0.0:8080" in socket["Listen"], socket
    log = host.run("journalctl", "-u", "llmgw-gateway", "--no-pager").stdout
    assert "(socket from systemd)" in log, log[-2000:]


def test_restarts_of_the_gateway_and_the_control_plane_under_load_lose_no_request(
        host: SystemdContainer) -> None:
    """Keep-alive clients (streams among them) through `systemctl restart llmgw-gateway`
    (connections wait in the socket unit's backlog, the old process drains) and a restart
    of the control plane: every answer whole. The negative control: with the socket unit
    stopped too for a second, clients are refused."""
    body = {"model": "qwen-0.5b", "max_tokens": 4,
            "messages": [{"role": "user", "content": "hello"}]}
    with Load("http://127.0.0.1:8080", body, key=owner_key(host)) as load:
        load.wait_for(20)
        host.run("systemctl", "restart", "llmgw-gateway")
        load.wait_for(20)
        host.run("systemctl", "restart", "llmgw-server")
        load.wait_for(20)
    assert load.failures == [], f"{len(load.failures)} of {load.done}: {load.failures[:5]}"
    with Load("http://127.0.0.1:8080", body, key=owner_key(host)) as load:
        load.wait_for(20)
        host.run("systemctl", "stop", "llmgw-gateway.socket", "llmgw-gateway")
        time.sleep(1)
        host.run("systemctl", "start", "llmgw-gateway.socket", "llmgw-gateway")
        load.wait_for(20)
    assert any("ConnectError" in f for f in load.failures), load.failures[:5]


def test_a_newer_checkout_is_installed_and_the_units_restarted(host: SystemdContainer) -> None:
    """A commit in the clone, then scripts/up: `done llmgw … installed (was …)`, the three
    units restarted onto it, the engine kept, and the checks agree with the checkout."""
    init = f"{CLONE}/src/llmgw/__init__.py"
    host.path(init).write_text(host.path(init).read_text() + "# a newer release\n")
    host.run("git", "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-qam",
             "a newer release", cwd=CLONE)
    pids, engines = {u: main_pid(host, u) for u in UNITS}, engine_pids(host)
    proc, steps = up(host, "/root/up-3.json")
    assert proc.returncode == 0, proc.stdout[-6000:]
    done = [s["message"] for s in steps if s["status"] == "done"]
    assert len(done) == 1 and "installed in /opt/llmgw (was 0.1.0 (" in done[0], done
    assert "restarted llmgw-server, llmgw-gateway, llmgw-mirror, llmgw-agent" in done[0], done
    assert "`pytest checks/` passed after the upgrade" in proc.stdout, proc.stdout[-3000:]
    assert all(main_pid(host, u) != pids[u] for u in UNITS)
    assert engine_pids(host) == engines
    assert checks(host).returncode == 0


def test_the_host_serves_without_its_clone(host: SystemdContainer) -> None:
    """The clone moved away and all three units restarted: the gateway still answers."""
    host.run("mv", CLONE, f"{CLONE}.away")
    try:
        host.run("systemctl", "restart", *UNITS)
        wait_for("a chat completion through the gateway", lambda: ask(host), timeout_s=180)
    finally:
        host.run("mv", f"{CLONE}.away", CLONE)


def test_down_stops_and_disables_everything_and_keeps_the_data(host: SystemdContainer) -> None:
    pids = engine_pids(host)
    proc = host.run("/usr/local/bin/llmgw", "down")
    for unit in UNITS:
        props = host.show(unit, "ActiveState", "UnitFileState")
        assert props == {"ActiveState": "inactive", "UnitFileState": "disabled"}, (unit, props)
    for pid in pids.values():
        assert host.run("kill", "-0", str(pid), check=False).returncode != 0, proc.stdout
    for kept in ("/etc/llmgw/server.yaml", "/etc/llmgw/pki/ca-key.pem",
                 "/var/lib/llmgw", f"/srv/models/{STARTER}/starter"):
        assert host.path(kept).exists(), kept
