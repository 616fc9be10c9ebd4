"""supervisord in local mode: programs defined, started, updated, read back, stopped."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw.host.changes import Run
from llmgw.host.services import Action, ServiceSpec
from llmgw.host.services._supervisor import _STOP_MARGIN_S, Supervisor


def _sleeper(name: str, seconds: int) -> ServiceSpec:
    return ServiceSpec(name=name, description="a sleeper",
                       command=[sys.executable, "-c", f"import time; time.sleep({seconds})"])


@pytest.fixture
def supervisor(tmp_path: Path) -> Iterator[Supervisor]:
    sup = Supervisor(tmp_path / "host")
    yield sup
    sup.stop_daemon()


def test_ensure_starts_then_keeps_then_restarts_on_change(supervisor: Supervisor) -> None:
    assert not supervisor.daemon_running()
    assert supervisor.ensure(_sleeper("sleeper", 300))
    assert supervisor.is_running("sleeper")
    pid = supervisor.pid("sleeper")
    assert not supervisor.ensure(_sleeper("sleeper", 300)), "nothing differed, nothing changed"
    assert supervisor.pid("sleeper") == pid
    assert supervisor.ensure(_sleeper("sleeper", 301))
    assert supervisor.is_running("sleeper") and supervisor.pid("sleeper") != pid


def test_describe_names_the_state_and_the_log(supervisor: Supervisor) -> None:
    assert "not running" in supervisor.describe("sleeper")
    supervisor.ensure(_sleeper("sleeper", 300))
    assert "RUNNING" in supervisor.describe("sleeper")
    assert "not defined" in supervisor.describe("other")
    assert "sleeper.log" in supervisor.start_hint("sleeper")


def test_stop_daemon_stops_programs(supervisor: Supervisor) -> None:
    supervisor.ensure(_sleeper("sleeper", 300))
    pid = supervisor.pid("sleeper")
    assert supervisor.stop_daemon()
    assert not supervisor.daemon_running()
    assert not Path(f"/proc/{pid}").exists()
    assert not supervisor.stop_daemon(), "a second stop finds nothing running"


def test_a_shutdown_waits_for_every_programs_stop_in_turn(supervisor: Supervisor) -> None:
    """supervisord stops its programs one after another, so `llmgw down` waits for the sum
    of their stop bounds (a gateway draining 30 s, then the rest), not one fixed bound."""
    supervisor.programs.mkdir(parents=True)
    for name, stop_s in (("draining", 45), ("quick", 15)):
        spec = ServiceSpec(name=name, description="d", command=["true"], stop_timeout_s=stop_s)
        supervisor.definition_path(name).write_text(supervisor.render_program(spec))
    assert supervisor.stop_bound_s() == 45 + 15 + _STOP_MARGIN_S


def test_programs_inherit_a_raised_open_file_limit(supervisor: Supervisor) -> None:
    """supervisord raises its limit to minfds and its programs inherit it."""
    from llmgw.host.services._supervisor import open_files_limit

    out = supervisor.root / "nofile"
    code = f"import resource; open({str(out)!r}, 'w').write(str(resource.getrlimit(7)[0]))"
    supervisor.ensure(ServiceSpec(name="limits", description="limits",
                                  command=[sys.executable, "-c", code + "; import time; "
                                           "time.sleep(60)"]))
    import time
    deadline = time.monotonic() + 10
    while not out.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert int(out.read_text()) >= min(open_files_limit(), 4096)


def test_an_environment_file_reads_back_what_was_written(tmp_path) -> None:
    """The mirror's --env-file reader is the inverse of the writer, quotes and backslashes
    included; no file reads as nothing; a line that is not KEY=VALUE is refused."""
    from llmgw.host.services import ServiceError, read_environment_file, render_environment_file

    path = tmp_path / "mirror.env"
    assert read_environment_file(path) == {}
    env = {"HF_TOKEN": 'a"b\\c d', "HF_ENDPOINT": "https://hub.example"}
    path.write_text(render_environment_file(env))
    assert read_environment_file(path) == env
    path.write_text("not a line\n")
    with pytest.raises(ServiceError, match="line 1 is not KEY=VALUE"):
        read_environment_file(path)


def test_reload_signals_the_running_program_instead_of_restarting_it(
        supervisor: Supervisor, tmp_path: Path) -> None:
    """The gateway's handover path: the same process gets SIGHUP (and hands its socket to a
    new worker); a restart would refuse connections meanwhile."""
    seen = tmp_path / "hups"
    # One line: supervisord's config holds the command on one.
    script = (f"import pathlib, signal, time; p = pathlib.Path({str(seen)!r}); "
              "signal.signal(signal.SIGHUP, lambda *a: p.open('a').write('h')); "
              "[time.sleep(0.05) for _ in iter(int, 1)]")
    supervisor.ensure(ServiceSpec(name="hupper", description="counts SIGHUPs",
                                  command=[sys.executable, "-c", script], stop_timeout_s=45))
    assert "stopwaitsecs=45\n" in supervisor.definition_path("hupper").read_text()
    pid = supervisor.pid("hupper")
    supervisor.reload("hupper")
    supervisor.reload("hupper")
    deadline = time.monotonic() + 10
    while (seen.read_text() if seen.exists() else "") != "hh" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert seen.read_text() == "hh"
    assert supervisor.pid("hupper") == pid


def _shown(actions: list[Action]) -> list[str]:
    return [" ".join(a.argv[3:]) if isinstance(a, Run) else f"{type(a).__name__} {a.path}"
            for a in actions]


def test_the_plan_is_what_ensure_does_and_nothing_once_done(supervisor: Supervisor) -> None:
    """A fresh root: supervisord's conf, its folders, supervisord, the program's conf, then
    supervisorctl's update and start; none of it made by planning. After ensure the plan
    is empty; a changed program plans its file and update only (negative control)."""
    spec = _sleeper("sleeper", 300)
    conf, program = supervisor.conf, supervisor.definition_path("sleeper")
    ctl = f"-c {conf}"
    plan = supervisor.plan_ensure(spec)
    assert _shown(plan) == [
        f"WriteFile {conf}", f"Mkdir {supervisor.logs}", f"Mkdir {supervisor.programs}",
        f"{ctl}", f"WriteFile {program}", f"{ctl} update sleeper", f"{ctl} start sleeper"]
    assert plan[3] == Run((sys.executable, "-m", "supervisor.supervisord", "-c", str(conf)))
    assert not supervisor.root.exists(), "a plan wrote"
    assert supervisor.ensure(spec) and supervisor.is_running("sleeper")
    assert supervisor.plan_ensure(spec) == []
    assert _shown(supervisor.plan_ensure(_sleeper("sleeper", 301))) == [
        f"WriteFile {program}", f"{ctl} update sleeper"]
    assert _shown(supervisor.plan_reload("sleeper")) == [f"{ctl} signal HUP sleeper"]
    assert _shown(supervisor.plan_restart("sleeper")) == [f"{ctl} restart sleeper"]
