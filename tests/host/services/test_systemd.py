"""systemd units: their text, their validity, and rewriting only what differs."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llmgw.host.changes import Run, WriteFile
from llmgw.host.services import Action, ServiceSpec
from llmgw.host.services._systemd import Systemd, render_socket, render_unit

SPEC = ServiceSpec(
    name="llmgw-test",
    description="llmgw test unit",
    command=[sys.executable, "-m", "llmgw", "server", "--config", "/etc/llmgw/server.yaml"],
    systemd_service=["Restart=on-failure", "KillMode=process"],
    environment={"A": "1 2"},
)


def test_unit_text_holds_command_and_service_lines() -> None:
    text = render_unit(SPEC)
    assert f"ExecStart={sys.executable} -m llmgw server --config /etc/llmgw/server.yaml" in text
    assert "KillMode=process\n" in text and "Restart=on-failure\n" in text
    assert "Environment='A=1 2'" in text
    assert text.index("[Service]") < text.index("ExecStart") < text.index("[Install]")


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="no systemd-analyze here")
def test_systemd_analyze_verify_passes(tmp_path) -> None:
    unit = tmp_path / "llmgw-test.service"
    unit.write_text(render_unit(SPEC))
    proc = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="no systemd-analyze here")
def test_negative_control_systemd_analyze_rejects_a_broken_unit(tmp_path) -> None:
    unit = tmp_path / "llmgw-test.service"
    unit.write_text(render_unit(SPEC).replace(f"ExecStart={sys.executable}", "ExecStart=nothere"))
    proc = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True)
    assert proc.returncode != 0


def test_unit_is_written_only_when_it_differs_and_the_old_kept(tmp_path) -> None:
    systemd = Systemd(unit_dir=tmp_path)
    assert systemd.write_unit(SPEC)
    path = tmp_path / "llmgw-test.service"
    mtime = path.stat().st_mtime_ns
    assert not systemd.write_unit(SPEC)
    assert path.stat().st_mtime_ns == mtime
    path.write_text(path.read_text() + "# edited by a person\n")
    assert systemd.write_unit(SPEC)
    assert (tmp_path / "llmgw-test.service.bak").read_text().endswith("# edited by a person\n")
    assert path.read_text() == render_unit(SPEC)


def test_units_may_open_enough_files_for_a_fleet() -> None:
    """The agent API holds a socket per node: 1,024 open files would cap the fleet."""
    assert "LimitNOFILE=65536\n" in render_unit(SPEC)
    own = ServiceSpec(name="x", description="x", command=["x"],
                      systemd_service=["LimitNOFILE=8"])
    assert render_unit(own).count("LimitNOFILE") == 1


SOCKETED = ServiceSpec(name="llmgw-test", description="llmgw test unit",
                       command=[sys.executable, "-m", "llmgw", "gateway"],
                       socket=["ListenStream=127.0.0.1:8080"])


def test_a_spec_with_socket_lines_gets_a_socket_unit_the_service_requires(tmp_path) -> None:
    systemd = Systemd(unit_dir=tmp_path)
    assert systemd.write_unit(SOCKETED)
    socket_unit = (tmp_path / "llmgw-test.socket").read_text()
    assert socket_unit == render_socket(SOCKETED)
    assert "[Socket]\n" in socket_unit and "ListenStream=127.0.0.1:8080\n" in socket_unit
    assert "Requires=llmgw-test.socket\n" in (tmp_path / "llmgw-test.service").read_text()
    assert systemd.definition_drift(SOCKETED) == ""
    assert not systemd.write_unit(SOCKETED)
    (tmp_path / "llmgw-test.socket").write_text(socket_unit.replace("8080", "8090"))
    assert "llmgw-test.socket differs" in systemd.definition_drift(SOCKETED)
    assert systemd.write_unit(SOCKETED)
    assert not (tmp_path / "llmgw-test.service.bak").exists()


def test_a_spec_without_socket_lines_gets_no_socket_unit(tmp_path) -> None:
    Systemd(unit_dir=tmp_path).write_unit(SPEC)
    assert not (tmp_path / "llmgw-test.socket").exists()
    assert "Requires=" not in render_unit(SPEC)


def _systemctl_says(tmp_path, monkeypatch, **states: str) -> None:  # type: ignore[no-untyped-def]
    """A stand-in systemctl on PATH (the program, not the logic under test) whose
    is-enabled prints each unit's state from states and exits 0 only for `enabled`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    cases = "".join(f'  {unit}) echo {state}; [ {state} = enabled ]; exit $? ;;\n'
                    for unit, state in states.items())
    script = bin_dir / "systemctl"
    script.write_text(f'#!/bin/sh\n[ "$1" = is-enabled ] || exit 3\ncase "$2" in\n{cases}'
                      '  *) echo not-found; exit 4 ;;\nesac\n')
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")


def test_a_disabled_unit_is_named(tmp_path, monkeypatch) -> None:
    _systemctl_says(tmp_path, monkeypatch, **{"llmgw-test": "disabled"})
    assert Systemd(tmp_path).not_enabled(SPEC) == "llmgw-test is disabled under systemd"


def test_an_enabled_unit_is_not_named(tmp_path, monkeypatch) -> None:
    _systemctl_says(tmp_path, monkeypatch, **{"llmgw-test": "enabled"})
    assert Systemd(tmp_path).not_enabled(SPEC) == ""


def test_a_socket_units_own_state_counts_too(tmp_path, monkeypatch) -> None:
    """The gateway's socket holds its connections across restarts: a disabled socket leaves
    the port unbound after a reboot even with the service enabled."""
    spec = ServiceSpec(name="llmgw-test", description="t", command=["true"],
                       socket=["ListenStream=127.0.0.1:1"])
    _systemctl_says(tmp_path, monkeypatch,
                    **{"llmgw-test": "enabled", "llmgw-test.socket": "disabled"})
    assert Systemd(tmp_path).not_enabled(spec) == "llmgw-test.socket is disabled under systemd"


def _systemctl_logs(tmp_path, monkeypatch, active: bool) -> Path:  # type: ignore[no-untyped-def]
    """A stand-in systemctl on PATH that writes each command that changes something to a
    log, one line each, and answers is-active with active."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "systemctl.log"
    script = bin_dir / "systemctl"
    script.write_text(f'#!/bin/sh\n[ "$1" = is-active ] && exit {0 if active else 3}\n'
                      f'echo "systemctl $*" >> {log}\n')
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    return log


def _commands(actions: list[Action]) -> list[str]:
    return [" ".join(a.argv) for a in actions if isinstance(a, Run)]


def test_ensure_runs_exactly_the_commands_its_plan_lists(tmp_path, monkeypatch) -> None:
    """A new unit: the plan is the unit file, daemon-reload and enable --now; ensure writes
    that file and runs those commands, no others. Planned again: only enable --now."""
    log = _systemctl_logs(tmp_path, monkeypatch, active=False)
    systemd = Systemd(unit_dir=tmp_path / "units")
    plan = systemd.plan_ensure(SPEC)
    assert plan[0] == WriteFile(tmp_path / "units" / "llmgw-test.service", render_unit(SPEC))
    assert _commands(plan) == ["systemctl daemon-reload", "systemctl enable --now llmgw-test"]
    assert not (tmp_path / "units").exists(), "a plan wrote"
    assert systemd.ensure(SPEC)
    assert log.read_text().splitlines() == _commands(plan)
    assert _commands(systemd.plan_ensure(SPEC)) == ["systemctl enable --now llmgw-test"]
    assert [a for a in systemd.plan_ensure(SPEC) if isinstance(a, WriteFile)] == []


def test_a_changed_unit_of_a_running_service_plans_its_restart(tmp_path, monkeypatch) -> None:
    """Negative control of the above: the unit edited, the service running, the plan keeps
    the old unit as .bak and restarts it; behind a socket, the socket is bound again."""
    log = _systemctl_logs(tmp_path, monkeypatch, active=True)
    systemd = Systemd(unit_dir=tmp_path)
    systemd.write_unit(SOCKETED)
    (tmp_path / "llmgw-test.service").write_text("edited\n")
    plan = systemd.plan_ensure(SOCKETED)
    unit = tmp_path / "llmgw-test.service"
    assert plan[0] == WriteFile(unit, render_unit(SOCKETED), backup=tmp_path / f"{unit.name}.bak")
    assert _commands(plan) == [
        "systemctl daemon-reload", "systemctl enable --now llmgw-test.socket",
        "systemctl enable --now llmgw-test", "systemctl stop llmgw-test",
        "systemctl restart llmgw-test.socket", "systemctl start llmgw-test"]
    systemd.ensure(SOCKETED)
    assert log.read_text().splitlines() == _commands(plan)
    assert (tmp_path / "llmgw-test.service.bak").read_text() == "edited\n"
    assert _commands(systemd.plan_restart("llmgw-test")) == ["systemctl restart llmgw-test"]
