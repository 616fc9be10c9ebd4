"""After an upgrade, `pytest checks/` decides: kept when they pass, rolled back when not."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from llmgw.host import install, release_gate
from tests.host.test_install import _two_releases, tmp_path  # noqa: F401  (its fixture)

PASS = [sys.executable, "-c", "raise SystemExit(0)"]
FAIL = [sys.executable, "-c", "raise SystemExit(1)"]


def test_no_pending_upgrade_runs_nothing(tmp_path: Path) -> None:  # noqa: F811
    assert release_gate.gate(["/nonexistent/checks"], tmp_path / "opt") == 0


def test_checks_that_pass_keep_the_new_release(tmp_path: Path,  # noqa: F811
                                               capsys: pytest.CaptureFixture[str]) -> None:
    co, venv, link, run, upgraded = _two_releases(tmp_path)
    assert release_gate.gate(PASS, venv, link) == 0
    assert install.installed_release(venv) == upgraded.release
    assert install.pending_upgrade(venv) is None
    assert f"done llmgw {upgraded.release.label()} kept" in capsys.readouterr().out


def test_checks_that_fail_restore_the_previous_release_naming_both(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]  # noqa: F811
) -> None:
    co, venv, link, run, upgraded = _two_releases(tmp_path)
    assert upgraded.previous is not None
    assert release_gate.gate(FAIL, venv, link) == 1
    assert install.installed_release(venv) == upgraded.previous
    out = capsys.readouterr().out
    assert (f"FAILED upgrade to llmgw {upgraded.release.label()}: `pytest checks/` failed"
            in out), out
    assert (f"rolled back llmgw {upgraded.release.label()} to {upgraded.previous.label()}"
            in out), out
    # Negative control: a second run has nothing pending, so nothing is rolled back again.
    assert release_gate.gate(FAIL, venv, link) == 0
    assert install.installed_release(venv) == upgraded.previous


def test_the_checks_get_the_options_of_scripts_up_but_not_its_steps_file() -> None:
    """The steps file records what provisioning did: the checks must not write over it."""
    argv = ["--advertise", "127.0.0.1", "--steps-json=/root/up.json", "--steps-json", "/x",
            "--no-starter"]
    assert release_gate.checks_args(argv) == ["--advertise", "127.0.0.1", "--no-starter"]


def test_the_gate_runs_the_checks_of_the_checkout_it_was_installed_from() -> None:
    """The gate runs `pytest checks/` of the checkout scripts/up ran from: CHECKOUT is that
    checkout's root, whatever folder of src/ the gate's module sits in (the move of issue 41
    left it pointing at src/, so every upgrade ran no test and was rolled back)."""
    root = Path(__file__).resolve().parents[2]
    assert release_gate.CHECKOUT == root
    assert (release_gate.CHECKOUT / "checks" / "conftest.py").is_file()
    # Its control: one folder short of the root is where the moved module pointed, and no
    # checks/ stands there.
    assert not (release_gate.CHECKOUT / "src" / "checks").exists()
