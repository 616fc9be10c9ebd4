"""The prebuilt engine: xllamacpp's CPU wheel in a venv of the cache, behind a llama-server.

    <cache_dir>/engines/xllamacpp/<version>/venv/           python -m venv + the wheel
    <cache_dir>/engines/xllamacpp/<version>/llama-server    prebuilt_server.py, shebang'd
    <cache_dir>/engines/xllamacpp/<version>/install.log     what pip said
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
from pathlib import Path

from llmgw.agent.engines import cache, prebuilt_server
from llmgw.agent.engines._build import BuildError
from llmgw.host.commands import CommandFailed, run_logged

ENGINE = prebuilt_server.DIST
VERSION = prebuilt_server.VERSION
INSTALL_TIMEOUT_S = 900


def home(cache_dir: Path) -> Path:
    return cache.prebuilt(cache_dir, ENGINE, VERSION)


def launcher(cache_dir: Path) -> Path:
    return home(cache_dir) / "llama-server"


def _python(cache_dir: Path) -> Path:
    return home(cache_dir) / "venv" / "bin" / "python"


def installed(cache_dir: Path) -> bool:
    """Whether the venv holds the wheel (a marker written only after pip succeeded)."""
    return (home(cache_dir) / "venv" / ".installed").is_file() and _python(cache_dir).exists()


def write_launcher(cache_dir: Path) -> Path:
    """The launcher, rewritten when this llmgw's prebuilt_server.py differs from it."""
    target = launcher(cache_dir)
    text = f"#!{_python(cache_dir)}\n" + Path(prebuilt_server.__file__).read_text()
    if not target.is_file() or target.read_text() != text:
        tmp = target.with_name(".llama-server.tmp")
        tmp.write_text(text)
        tmp.chmod(0o755)
        tmp.replace(target)
    return target


def install(cache_dir: Path) -> Path:
    """Make the venv and pip-install the pinned wheel into it (one install at a time)."""
    where = home(cache_dir)
    where.mkdir(parents=True, exist_ok=True)
    with open(cache.lock_file(where), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not installed(cache_dir):
            _install_locked(cache_dir)
    return write_launcher(cache_dir)


def _install_locked(cache_dir: Path) -> None:
    venv = home(cache_dir) / "venv"
    shutil.rmtree(venv, ignore_errors=True)
    log = home(cache_dir) / "install.log"
    python = _base_python()
    _run([python, "-m", "venv", str(venv)], log, "making the venv")
    _run([str(_python(cache_dir)), "-m", "pip", "install", "--disable-pip-version-check",
          "--no-input", "--only-binary", ":all:", f"{ENGINE}=={VERSION}"], log,
         f"installing the {ENGINE} {VERSION} wheel")
    (venv / ".installed").write_text(f"{ENGINE}=={VERSION}\n")


def _base_python() -> str:
    # The interpreter behind this venv: a venv made from a venv's python links to it anyway.
    return getattr(sys, "_base_executable", "") or sys.executable


def _run(cmd: list[str], log: Path, what: str) -> None:
    try:
        run_logged(cmd, what=what, log=log, timeout_s=INSTALL_TIMEOUT_S,
                   env={**os.environ, "PIP_NO_INPUT": "1"})
    except CommandFailed as e:
        raise BuildError(e.told(
            "Check the package index this machine uses (pip's config), or set "
            "engine.prebuilt: off in agent.yaml to build the pinned source, then restart the "
            "agent")) from None
