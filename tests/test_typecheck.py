"""The type check scripts/test runs holds what pyproject.toml's [tool.mypy] promises: the
contract and the configuration are checked strictly, the rest with mypy's defaults, and
scripts/test stops on a type error before any test runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
UNTYPED = "def double(x):\n    return x * 2\n"
TYPED_BADLY = "def double(x: int) -> str:\n    return x * 2\n"
# The fix is of another length: mypy trusts its cache for a file whose size and mtime (in whole
# seconds) are unchanged, and "-> int" is as long as "-> str".
FIXED = "def double(x: int) -> int:\n    return 2 * x  # fixed\n"


def _tree(root: Path, files: dict[str, str]) -> Path:
    """A checkout in miniature: the project's pyproject.toml and these files under it."""
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    tree = {"src/llmgw/__init__.py": "", "src/llmgw_harness/__init__.py": "", **files}
    for name, text in tree.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def _mypy(root: Path) -> subprocess.CompletedProcess[str]:
    """mypy as scripts/test runs it (no arguments: the configuration says what), in root."""
    return subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(root / ".cache")],
                          cwd=root, capture_output=True, text=True, timeout=300)


def _flagged(run: subprocess.CompletedProcess[str]) -> set[str]:
    return {line.split(":", 1)[0] for line in run.stdout.splitlines() if ": error:" in line}


def test_contract_and_config_are_strict_and_the_rest_is_not(tmp_path: Path) -> None:
    """An unannotated function is an error in llmgw.contract and llmgw.config, and the same
    function elsewhere in src/llmgw and in src/llmgw_harness is not (the negative control:
    the override, not the code, makes the difference)."""
    root = _tree(tmp_path, {
        "src/llmgw/contract/__init__.py": UNTYPED,
        "src/llmgw/contract/shapes.py": UNTYPED,
        "src/llmgw/config.py": UNTYPED,
        "src/llmgw/loose.py": UNTYPED,
        "src/llmgw_harness/loose.py": UNTYPED,
    })
    run = _mypy(root)
    assert _flagged(run) == {"src/llmgw/contract/__init__.py", "src/llmgw/contract/shapes.py",
                             "src/llmgw/config.py"}, run.stdout + run.stderr
    assert "[no-untyped-def]" in run.stdout


def test_every_module_under_src_is_checked(tmp_path: Path) -> None:
    """A wrong return type is found in src/llmgw and in src/llmgw_harness alike; with every
    file right, the same run passes (exit 0), so the failure is the type error's."""
    root = _tree(tmp_path, {"src/llmgw/wrong.py": TYPED_BADLY,
                            "src/llmgw_harness/wrong.py": TYPED_BADLY})
    run = _mypy(root)
    assert run.returncode == 1
    assert _flagged(run) == {"src/llmgw/wrong.py", "src/llmgw_harness/wrong.py"}, run.stdout
    for name in ("src/llmgw/wrong.py", "src/llmgw_harness/wrong.py"):
        (root / name).write_text(FIXED)
    fixed = _mypy(root)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr


@pytest.mark.skipif(not shutil.which("bash"), reason="scripts/test is a bash script")
def test_scripts_test_stops_on_a_type_error_and_says_how_to_see_it(tmp_path: Path) -> None:
    """scripts/test, in a checkout whose code has a type error, exits 1 before pytest runs
    and says what failed and the command that shows it again; with the error fixed it goes
    on to pytest (the negative control). bootstrap and pytest are stand-ins that say they
    ran, so no venv is made and no test runs."""
    root = _tree(tmp_path, {"src/llmgw/wrong.py": TYPED_BADLY})
    (root / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "test", root / "scripts" / "test")
    (root / "scripts" / "bootstrap").write_text("exit 0\n")
    bin_dir = root / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    python = bin_dir / "python"
    # mypy is the real one (with its cache in the tree); pytest only says it was started.
    python.write_text(f'#!/bin/sh\nif [ "$2" = pytest ]; then echo PYTEST-RAN; exit 0; fi\n'
                      f'exec {sys.executable} "$@" --cache-dir "{root / ".cache"}"\n')
    python.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MYPY")}

    def script() -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", str(root / "scripts" / "test")], cwd=root, env=env,
                              capture_output=True, text=True, timeout=300)

    failed = script()
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "PYTEST-RAN" not in failed.stdout
    assert "src/llmgw/wrong.py" in failed.stdout
    assert "the type check failed" in failed.stderr and ".venv/bin/mypy" in failed.stderr
    (root / "src/llmgw/wrong.py").write_text(FIXED)
    passed = script()
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert "PYTEST-RAN" in passed.stdout
