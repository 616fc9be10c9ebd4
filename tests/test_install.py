"""The installed llmgw of system mode: which interpreter, when to reinstall, what it says.

The real install (a venv, pip, systemd restarts) runs in tests/system; here the logic
runs against fake interpreters and a recording runner.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from llmgw import install

ROOT = Path(__file__).resolve().parent.parent


class Recorder:
    """A runner that answers like a Python 3.11 with venv, and remembers every argv."""

    def __init__(self, version: str = "3 11", fail: str = "") -> None:
        self.calls: list[list[str]] = []
        self.version, self.fail = version, fail

    def __call__(self, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        argv = list(argv)
        self.calls.append(argv)
        if self.fail and self.fail in " ".join(argv):
            return subprocess.CompletedProcess(argv, 1, "", "no such thing")
        if argv[1:2] == ["-c"]:
            return subprocess.CompletedProcess(argv, 0, self.version + "\n", "")
        if argv[1:3] == ["-m", "venv"]:
            venv = Path(argv[-1])
            (venv / "bin").mkdir(parents=True, exist_ok=True)
            (venv / "pyvenv.cfg").write_text(f"home = /usr/bin\nexecutable = {argv[0]}\n")
        if argv[:2] == ["systemctl", "is-active"]:
            return subprocess.CompletedProcess(argv, 0 if argv[-1] == "llmgw-agent" else 3,
                                               "", "")
        return subprocess.CompletedProcess(argv, 0, "", "")


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    """Function: an empty folder every user can search (pytest's own tmp_path sits in a
    0700 folder, which hides everything in it from other users)."""
    path = Path(tempfile.mkdtemp(prefix="llmgw-install-test-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def fake_python(path: Path, mode: int = 0o755) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(mode)
    return path


def checkout(tmp_path: Path) -> Path:
    co = tmp_path / "checkout"
    (co / "src" / "llmgw").mkdir(parents=True)
    shutil.copy(ROOT / "pyproject.toml", co)
    (co / "README.md").write_text("readme\n")
    (co / "src" / "llmgw" / "__init__.py").write_text("x = 1\n")
    return co


def test_an_interpreter_in_a_private_folder_is_passed_over(tmp_path: Path) -> None:
    """A python inside a 0700 folder (a pyenv under /root) cannot be run by user llmgw."""
    private = tmp_path / "private"
    hidden = fake_python(private / "python3")
    private.chmod(0o700)
    public = fake_python(tmp_path / "pub" / "python3")
    run = Recorder()
    assert install.find_interpreter([str(hidden), str(public)], run) == public
    assert install.hidden_from_services(hidden).endswith("is not searchable by other users")


def test_interpreters_under_a_home_are_refused() -> None:
    assert "home folder" in install.hidden_from_services(Path("/root/.pyenv/shims/python3"))


def test_no_usable_interpreter_says_what_to_install(tmp_path: Path) -> None:
    old = fake_python(tmp_path / "python3")
    with pytest.raises(install.InstallError) as e:
        install.find_interpreter([str(old), str(tmp_path / "missing")], Recorder("3 9"))
    message = str(e.value)
    assert "is Python 3.9" in message and "apt-get install python3 python3-venv" in message


def test_a_python_without_venv_is_passed_over(tmp_path: Path) -> None:
    python = fake_python(tmp_path / "python3")
    with pytest.raises(install.InstallError, match="lacks the venv module"):
        install.find_interpreter([str(python)], Recorder(fail="import sys, venv"))


def test_a_source_edit_is_a_new_release_a_readme_edit_is_not(tmp_path: Path) -> None:
    co = checkout(tmp_path)
    first = install.checkout_release(co)
    (co / "README.md").write_text("other\n")
    assert install.checkout_release(co) == first
    (co / "src" / "llmgw" / "__init__.py").write_text("x = 2\n")
    assert install.checkout_release(co).digest != first.digest


def test_install_then_keep_then_upgrade_and_restart(tmp_path: Path) -> None:
    """First run: venv made with the interpreter found, pip install, link, record.
    Second: nothing. After an edit: pip again, and the running units restarted."""
    co, venv, link = checkout(tmp_path), tmp_path / "opt" / "llmgw", tmp_path / "bin" / "llmgw"
    python = fake_python(tmp_path / "usr" / "python3")
    run = Recorder()
    kw = dict(venv=venv, link=link, units=("llmgw-server", "llmgw-agent"),
              candidates=[str(python)], run=run)

    first = install.install(co, **kw)
    assert first.changed and first.previous is None
    assert [str(python), "-m", "venv", "--clear", str(venv)] in run.calls
    assert any("pip" in c and "--force-reinstall" in c for c in run.calls)
    assert link.readlink() == venv / "bin" / "llmgw"
    assert json.loads((venv / "llmgw-install.json").read_text())["version"] == "0.1.0"
    assert first.line(venv) == f"llmgw 0.1.0 installed in {venv}"
    assert install.drift(co, venv, link) == ""

    run.calls.clear()
    again = install.install(co, **kw)
    assert not again.changed and run.calls == []

    (co / "src" / "llmgw" / "__init__.py").write_text("x = 2\n")
    assert "but the checkout" in install.drift(co, venv, link)
    upgraded = install.install(co, **kw)
    assert upgraded.changed and upgraded.previous == first.release
    assert upgraded.restarted == ("llmgw-agent",)
    assert ["systemctl", "restart", "llmgw-agent"] in run.calls
    assert not any(c[1:3] == ["-m", "venv"] for c in run.calls)  # the venv is kept
    assert "(was 0.1.0)" in upgraded.line(venv) and "restarted llmgw-agent" in upgraded.line(venv)


def test_a_venv_made_with_a_hidden_interpreter_is_remade(tmp_path: Path) -> None:
    co, venv, link = checkout(tmp_path), tmp_path / "opt" / "llmgw", tmp_path / "bin" / "llmgw"
    python = fake_python(tmp_path / "usr" / "python3")
    venv.mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("executable = /root/.pyenv/versions/3.11.7/bin/python\n")
    run = Recorder()
    install.install(co, venv=venv, link=link, candidates=[str(python)], run=run)
    assert [str(python), "-m", "venv", "--clear", str(venv)] in run.calls


def test_a_failed_pip_says_what_failed(tmp_path: Path) -> None:
    co, venv = checkout(tmp_path), tmp_path / "opt" / "llmgw"
    python = fake_python(tmp_path / "usr" / "python3")
    with pytest.raises(install.InstallError, match="pip install of .* failed"):
        install.install(co, venv=venv, link=tmp_path / "llmgw", candidates=[str(python)],
                        run=Recorder(fail="-m pip"))
    assert install.drift(co, venv, tmp_path / "llmgw").startswith("no llmgw is installed")
