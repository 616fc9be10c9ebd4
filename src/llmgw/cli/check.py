"""`llmgw check`: the read-only promises of `pytest checks/`, from an installed llmgw.

The harness is the package `llmgw_harness` (src/llmgw_harness), installed beside llmgw.
It is loaded here, explicitly, and the checkout's conftest.py is not read, so the runner is
registered exactly once.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

import llmgw_harness.runner
from llmgw.contract.records import CheckRecord

__all__ = ["check"]


class _Records:
    """One record per promise that ran, {step, promise, status, message}: the run's own
    verdicts, read from the harness at the session's end."""

    def __init__(self) -> None:
        self.plugin = llmgw_harness.runner
        self.records: list[CheckRecord] = []

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.records = self.plugin.check_records(session.config)


def check(state_dir: str | None, mode: str, as_json: bool, extra: list[str]) -> int:
    """Run every promise's probe against this host; pytest's exit status."""
    with tempfile.TemporaryDirectory(prefix="llmgw-check-") as tmp:
        ini = Path(tmp) / "pytest.ini"
        ini.write_text("[pytest]\njunit_family = xunit1\n")
        args = [
            "--pyargs", "llmgw_harness.suite", "-p", "llmgw_harness.runner", "-c", str(ini),
            "--rootdir", tmp, "--noconftest", "-p", "no:cacheprovider", "-p", "no:randomly",
            f"--mode={mode}", "-rfs", *([f"--state-dir={state_dir}"] if state_dir else []),
            *extra,
        ]
        records = _Records()
        if as_json:  # stdout carries the records alone; pytest's own lines go to stderr
            with contextlib.redirect_stdout(sys.stderr):
                code = int(pytest.main([*args, "-q", "--no-header"], plugins=[records]))
        else:
            code = int(pytest.main(args, plugins=[records]))
    if as_json:
        for record in records.records:
            print(json.dumps(record))
    return code


def main_args(args: Any) -> int:
    if getattr(args, "serve", None):
        from llmgw.cli.watch import serve_main

        return serve_main(args)
    sys.stdout.flush()
    return check(args.state_dir, args.mode, args.json, args.pytest_args)
