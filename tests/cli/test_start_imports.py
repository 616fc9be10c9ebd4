"""Every `llmgw` command pays for what the CLI imports at start: the scheduler and the store
(SQLAlchemy's ORM side, alembic) are imported only by the verbs that use them, when they
run. (A models-add change that imported the scheduler with its module made every command,
`--version` included, 2.3 times slower to start: 818 ms against 351.)"""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("llmgw.control.scheduler", "llmgw.store")


def loaded_at_start(module: str) -> list[str]:
    """Which of HEAVY importing module pulls in, in a fresh interpreter."""
    code = (f"import sys, {module}; "
            f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)
    return [m for m in done.stdout.strip().split(",") if m]


def test_the_cli_starts_without_the_scheduler_or_the_store() -> None:
    assert loaded_at_start("llmgw.cli.command") == []
    # Negative control: the check sees them where they are imported.
    assert loaded_at_start("llmgw.control.scheduler") == list(HEAVY)
