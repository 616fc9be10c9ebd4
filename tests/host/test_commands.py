"""The logged command runner pip, cmake and systemctl share: output to the log, a failure
told with its last lines and where the whole log is, a command past its time ended."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from llmgw.host.commands import CommandFailed, run_logged, tail

SAYS = ["sh", "-c", "echo one; echo; echo two; echo three >&2; echo four; exit {rc}"]


def _says(rc: int) -> list[str]:
    return [*SAYS[:2], SAYS[2].format(rc=rc)]


def test_a_command_that_succeeds_leaves_its_lines_in_the_log(tmp_path: Path) -> None:
    """The control of the next test: status 0 raises nothing; the log holds `$ cmd` and
    every line (stderr too), appended to what was there; on_line sees each."""
    log = tmp_path / "x.log"
    log.write_text("before\n")
    seen: list[str] = []
    run_logged(_says(0), what="saying", log=log, on_line=seen.append)
    assert log.read_text().splitlines() == [
        "before", f"$ {' '.join(_says(0))}", "one", "", "two", "three", "four"]
    assert [line.strip() for line in seen] == ["one", "", "two", "three", "four"]


def test_a_failure_says_its_status_last_lines_and_where_the_log_is(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    with pytest.raises(CommandFailed) as e:
        run_logged(_says(3), what="saying", log=log)
    assert str(e.value) == f"saying failed (3): two | three | four; the whole log is {log}"
    assert e.value.told("Do this.") == f"{e.value}. Do this."


def test_without_a_log_file_the_failure_says_where_to_read_on() -> None:
    """systemctl's log is the journal: the message names it, as the caller words it."""
    with pytest.raises(CommandFailed, match=r"^saying failed \(1\): .*four; see the journal$"):
        run_logged(_says(1), what="saying", where="see the journal")


def test_a_command_past_its_time_is_ended_and_said_so(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    started = time.monotonic()
    with pytest.raises(CommandFailed) as e:
        run_logged(["sh", "-c", "sleep 30"], what="sleeping", log=log, timeout_s=0.5)
    assert time.monotonic() - started < 10
    assert (str(e.value), e.value.returncode) == (f"sleeping took over 0.5s; see {log}", None)
    assert e.value.told("advice") == str(e.value)


def test_the_tail_is_the_last_lines_that_say_something() -> None:
    assert tail(["a", " ", "b  ", "", "c", "d"]) == "b | c | d"
    assert tail(["", "  "]) == "no output"
