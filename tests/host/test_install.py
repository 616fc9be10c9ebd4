"""The installed llmgw of system mode: which interpreter, when to reinstall, what it says.

The real install (a venv, pip, systemd restarts) runs in tests/system; here the logic
runs against fake interpreters and a recording runner.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from llmgw.host import install

ROOT = Path(__file__).resolve().parents[2]


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
    """First run: a release venv made with the interpreter found, pip install, current,
    link, record. Second: nothing. After an edit: a second release beside the first,
    current swapped to it, the first kept as previous, the running units restarted."""
    co, venv, link = checkout(tmp_path), tmp_path / "opt" / "llmgw", tmp_path / "bin" / "llmgw"
    python = fake_python(tmp_path / "usr" / "python3")
    run = Recorder()
    kw = dict(venv=venv, link=link, units=("llmgw-server", "llmgw-agent"),
              candidates=[str(python)], run=run)

    first = install.install(co, **kw)
    one = venv / "releases" / install.release_name(first.release)
    assert first.changed and first.previous is None
    assert [str(python), "-m", "venv", "--clear", str(one)] in run.calls
    assert any("pip" in c and "--force-reinstall" in c for c in run.calls)
    assert (venv / "current").readlink() == Path("releases") / one.name
    assert link.readlink() == venv / "current" / "bin" / "llmgw"
    assert json.loads((one / "llmgw-install.json").read_text())["version"] == "0.1.0"
    assert first.line(venv) == f"llmgw 0.1.0 installed in {venv}"
    assert install.drift(co, venv, link) == "" and install.pending_upgrade(venv) is None

    run.calls.clear()
    again = install.install(co, **kw)
    assert not again.changed and run.calls == []

    (co / "src" / "llmgw" / "__init__.py").write_text("x = 2\n")
    assert "but the checkout" in install.drift(co, venv, link)
    upgraded = install.install(co, **kw)
    two = venv / "releases" / install.release_name(upgraded.release)
    assert upgraded.changed and upgraded.previous == first.release and two != one
    assert (venv / "current").readlink() == Path("releases") / two.name
    assert (venv / "previous").readlink() == Path("releases") / one.name
    assert install.installed_release(venv, "previous") == first.release
    assert install.pending_upgrade(venv) == (upgraded.release, first.release)
    assert upgraded.restarted == ("llmgw-agent",)
    assert ["systemctl", "restart", "llmgw-agent"] in run.calls
    assert "(was 0.1.0)" in upgraded.line(venv) and "restarted llmgw-agent" in upgraded.line(venv)


def _two_releases(tmp_path: Path) -> tuple[Path, Path, Path, Recorder, install.Installed]:
    co, venv, link = checkout(tmp_path), tmp_path / "opt" / "llmgw", tmp_path / "bin" / "llmgw"
    run = Recorder()
    kw = dict(venv=venv, link=link, candidates=[str(fake_python(tmp_path / "usr" / "py"))],
              run=run, units=("llmgw-agent",))
    install.install(co, **kw)
    (co / "src" / "llmgw" / "__init__.py").write_text("x = 2\n")
    return co, venv, link, run, install.install(co, **kw)


def test_a_rollback_makes_the_previous_release_current_and_names_both(tmp_path: Path) -> None:
    co, venv, link, run, upgraded = _two_releases(tmp_path)
    run.calls.clear()
    done = install.rollback(venv=venv, link=link, units=("llmgw-server", "llmgw-agent"),
                            run=run)
    assert (done.undone, done.restored) == (upgraded.release, upgraded.previous)
    assert install.installed_release(venv) == upgraded.previous
    assert link.readlink() == venv / "current" / "bin" / "llmgw"
    assert not (venv / "previous").exists(), "a second rollback must not go back to it"
    assert install.pending_upgrade(venv) is None
    # Every unit given, failed or not: the release undone may be why one failed.
    assert ["systemctl", "restart", "llmgw-server", "llmgw-agent"] in run.calls
    assert done.line(venv) == (f"rolled back llmgw {upgraded.release.label()} to "
                               f"{upgraded.previous.label()} in {venv}; restarted "
                               "llmgw-server, llmgw-agent")
    assert "but the checkout" in install.drift(co, venv, link)


def test_a_rollback_without_a_previous_release_says_so(tmp_path: Path) -> None:
    co, venv, link = checkout(tmp_path), tmp_path / "opt" / "llmgw", tmp_path / "bin" / "llmgw"
    install.install(co, venv=venv, link=link, run=Recorder(),
                    candidates=[str(fake_python(tmp_path / "usr" / "py"))])
    with pytest.raises(install.InstallError, match="no previous release to restore"):
        install.rollback(venv=venv, link=link, run=Recorder())
    assert install.installed_release(venv) == install.checkout_release(co)


def test_current_is_swapped_by_rename_never_missing(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The switch is one rename(2) of a new symlink over current: no moment without one."""
    co, venv, link, run, upgraded = _two_releases(tmp_path)
    renames: list[tuple[str, str, str]] = []
    real = install.os.replace

    def watch(src: str | Path, dst: str | Path) -> None:
        assert Path(dst).is_symlink() or Path(dst) == venv / "previous", dst
        renames.append((Path(src).name, Path(dst).name, str(Path(src).readlink())))
        real(src, dst)

    monkeypatch.setattr(install.os, "replace", watch)
    install.rollback(venv=venv, link=link, run=run)
    assert renames[0][:2] == (".current.tmp", "current")


def test_an_upgrade_again_to_a_release_still_kept_reuses_its_venv(tmp_path: Path) -> None:
    co, venv, link, run, upgraded = _two_releases(tmp_path)
    install.rollback(venv=venv, link=link, run=run)
    run.calls.clear()
    again = install.install(co, venv=venv, link=link, run=run,
                            candidates=[str(fake_python(tmp_path / "usr" / "py"))])
    assert again.release == upgraded.release and again.previous == upgraded.previous
    assert not any("pip" in " ".join(c) for c in run.calls), run.calls


def test_a_third_release_removes_the_first(tmp_path: Path) -> None:
    co, venv, link, run, upgraded = _two_releases(tmp_path)
    (co / "src" / "llmgw" / "__init__.py").write_text("x = 3\n")
    third = install.install(co, venv=venv, link=link, run=run,
                            candidates=[str(fake_python(tmp_path / "usr" / "py"))])
    kept = sorted(p.name for p in (venv / "releases").iterdir())
    assert kept == sorted(install.release_name(r) for r in (upgraded.release, third.release))


def test_a_venv_of_the_old_layout_is_the_previous_release(tmp_path: Path) -> None:
    """An llmgw before releases made its venv straight in /opt/llmgw: it stays, as '.'."""
    co, venv, link = checkout(tmp_path), tmp_path / "opt" / "llmgw", tmp_path / "bin" / "llmgw"
    python = fake_python(tmp_path / "usr" / "python3")
    venv.mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text(f"executable = {python}\n")
    old = install.Release("0.1.0", "0ff1ce5", "d" * 64)
    (venv / "llmgw-install.json").write_text(json.dumps(dataclasses.asdict(old)))
    assert install.installed_release(venv) == old
    run = Recorder()
    done = install.install(co, venv=venv, link=link, candidates=[str(python)], run=run)
    assert done.previous == old and (venv / "previous").readlink() == Path(".")
    assert "(was 0.1.0 (0ff1ce5))" in done.line(venv)
    back = install.rollback(venv=venv, link=link, run=run)
    assert back.restored == old and install.installed_release(venv) == old
    assert (venv / "current" / "pyvenv.cfg").read_text() == f"executable = {python}\n"


def test_a_venv_made_with_a_hidden_interpreter_is_remade(tmp_path: Path) -> None:
    co, venv, link = checkout(tmp_path), tmp_path / "opt" / "llmgw", tmp_path / "bin" / "llmgw"
    python = fake_python(tmp_path / "usr" / "python3")
    folder = venv / "releases" / install.release_name(install.checkout_release(co))
    folder.mkdir(parents=True)
    (folder / "pyvenv.cfg").write_text("executable = /root/.pyenv/versions/3.11.7/bin/python\n")
    (venv / "current").symlink_to(folder.relative_to(venv))
    run = Recorder()
    install.install(co, venv=venv, link=link, candidates=[str(python)], run=run)
    assert [str(python), "-m", "venv", "--clear", str(folder)] in run.calls


def test_a_failed_pip_says_what_failed(tmp_path: Path) -> None:
    co, venv = checkout(tmp_path), tmp_path / "opt" / "llmgw"
    python = fake_python(tmp_path / "usr" / "python3")
    with pytest.raises(install.InstallError, match="pip install of .* failed"):
        install.install(co, venv=venv, link=tmp_path / "llmgw", candidates=[str(python)],
                        run=Recorder(fail="-m pip"))
    assert install.drift(co, venv, tmp_path / "llmgw").startswith("no llmgw is installed")
