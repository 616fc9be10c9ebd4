"""examples/downstream as its users run it: llmgw from a built wheel (not this checkout) in a
fresh venv with the example project, whose tests, using only the public fixtures, pass."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "downstream"
# What a clean checkout would not hand the build: the venv, earlier builds, caches.
NOT_SOURCE = shutil.ignore_patterns(".venv", ".git", "build", "dist", "*.egg-info",
                                    "__pycache__", ".pytest_cache", ".ruff_cache")

pytestmark = pytest.mark.slow


def _run(cmd: list[str], cwd: Path, timeout: float, env: dict[str, str]) -> str:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=env)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{output[-6000:]}"
    return output


def test_the_example_passes_against_an_installed_wheel(tmp_path, tiny_gguf, llama_server):
    # No PYTHONPATH and a cwd outside the checkout: only the wheel can provide llmgw.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    source, example = tmp_path / "llmgw", tmp_path / "downstream"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCE)
    shutil.copytree(EXAMPLE, example, ignore=NOT_SOURCE)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"),
          str(source)], tmp_path, 300, env)
    [wheel] = (tmp_path / "dist").glob("llmgw-*.whl")
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path, 120, env)
    python = str(venv / "bin" / "python")
    _run([python, "-m", "pip", "install", "-q", str(wheel), f"{example}[test]"], tmp_path, 600,
         env)
    where = _run([python, "-c", "import llmgw_harness, llmgw; print(llmgw.__file__)"],
                 example, 60, env)
    assert where.strip().startswith(str(venv)), where
    out = _run([python, "-m", "pytest", "-v", "-p", "no:randomly",
                "-o", f"llmgw_model={tiny_gguf[0]}"], example, 900, env)
    assert "3 passed" in out, out[-4000:]
