"""A command whose output matters when it fails: its lines go to a log, and a failure is an
error with its last lines and where the whole log is (pip, cmake, systemctl)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

from llmgw.errors import Error

TAIL_LINES = 3
_KEPT_LINES = 20  # of the output, in memory, for the tail (the log has them all)


class CommandFailed(Error):
    """A logged command ended with a non-zero status, or ran past its time (returncode
    None); the message says what it was, its status, its last lines and where to read on."""

    def __init__(self, what: str, returncode: int | None, tail: str, where: str,
                 timeout_s: float | None = None, log: Path | None = None) -> None:
        self.what, self.returncode, self.tail, self.where = what, returncode, tail, where
        self.timeout_s, self.log = timeout_s, log
        super().__init__(self.told())

    def told(self, advice: str = "") -> str:
        """The one-line message; advice (what to do) follows a failure, not a timeout."""
        if self.returncode is None:
            return f"{self.what} took over {self.timeout_s:g}s; see {self.log}"
        return (f"{self.what} failed ({self.returncode}): {self.tail}; {self.where}"
                + (f". {advice}" if advice else ""))


def run_logged(cmd: list[str], *, what: str, log: Path | None = None, where: str = "",
               timeout_s: float | None = None, env: Mapping[str, str] | None = None,
               on_line: Callable[[str], None] = lambda line: None,
               started: Callable[[subprocess.Popen[str]], None] = lambda proc: None) -> None:
    """Run cmd (no input, in a session of its own), its output appended to log after a
    `$ cmd` line (kept in memory only without one), each line handed to on_line; started
    gets the process (to stop it). CommandFailed on a non-zero status or past timeout_s,
    saying where to read on: where, else `the whole log is LOG`."""
    with (log or Path(os.devnull)).open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, stdin=subprocess.DEVNULL, start_new_session=True,
                                env=dict(env) if env is not None else None)
        started(proc)
        timer = _timer(proc, timeout_s)
        lines: list[str] = []
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                out.write(line)
                lines.append(line.rstrip())
                del lines[:-_KEPT_LINES]
                on_line(line)
            rc = proc.wait()
        finally:
            if timer is not None:
                timer.cancel()
    if timer is not None and timer.fired:
        raise CommandFailed(what, None, "", where, timeout_s, log)
    if rc != 0:
        raise CommandFailed(what, rc, tail(lines), where or f"the whole log is {log}",
                            timeout_s, log)


def tail(lines: list[str], n: int = TAIL_LINES) -> str:
    """The last n lines that say something, on one line."""
    kept = [line.strip() for line in lines if line.strip()][-n:]
    return " | ".join(kept) or "no output"


class _Timer(threading.Timer):
    fired = False


def _timer(proc: subprocess.Popen[str], timeout_s: float | None) -> _Timer | None:
    if timeout_s is None:
        return None

    def kill() -> None:
        timer.fired = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    timer = _Timer(timeout_s, kill)
    timer.daemon = True
    timer.start()
    return timer
