"""After `pytest provision/` upgraded llmgw: `pytest checks/`, and the previous release
back when they fail (scripts/up runs this)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from llmgw.host import install

CHECKOUT = Path(__file__).resolve().parents[3]  # src/llmgw/host/release_gate.py


def running_units() -> tuple[str, ...]:
    """The llmgw services systemd runs, starts or saw fail (a release that does not start
    leaves them failed); their sockets stay, as they hold the listeners."""
    systemctl = shutil.which("systemctl")
    if systemctl is None:
        return ()
    proc = subprocess.run(
        [systemctl, "list-units", "--type=service", "--state=active,activating,failed", "--plain",
         "--no-legend", "llmgw-*"], capture_output=True, text=True, check=False)
    return tuple(line.split()[0] for line in proc.stdout.splitlines() if line.strip())


def gate(checks: Sequence[str], venv: Path = install.VENV, link: Path = install.LINK) -> int:
    """Run checks when an upgrade is pending; confirm it, or roll it back and say so."""
    pending = install.pending_upgrade(venv)
    if pending is None:
        return 0
    new, old = pending
    print(f"llmgw {new.label()} was installed over {old.label()}: running `pytest checks/` "
          "before keeping it", flush=True)
    if subprocess.run(list(checks), check=False).returncode == 0:
        install.confirm_upgrade(venv)
        print(f"done llmgw {new.label()} kept: `pytest checks/` passed after the upgrade "
              f"(was {old.label()})", flush=True)
        return 0
    done = install.rollback(venv=venv, link=link, units=running_units())
    print(f"FAILED upgrade to llmgw {new.label()}: `pytest checks/` failed after it; "
          f"{done.line(venv)}, so the services run {old.label()} again", flush=True)
    return 1


def checks_args(argv: Sequence[str]) -> list[str]:
    """scripts/up's options for `pytest checks/`, less --steps-json: that file holds what
    provisioning did, and the checks must not write over it."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--steps-json":
            skip = True
        elif not arg.startswith("--steps-json="):
            out.append(arg)
    return out


def main(argv: Sequence[str]) -> int:
    checks = [sys.executable, "-m", "pytest", str(CHECKOUT / "checks"), "-p", "no:randomly",
              *checks_args(argv)]
    return gate(checks)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
