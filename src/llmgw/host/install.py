"""The installed llmgw of system mode: releases in /opt/llmgw that every service user can run.

Services under systemd must not run the checkout's own environment: a clone under /root,
or a venv whose interpreter lives there (pyenv), is hidden from user llmgw and from units
with ProtectHome=. So system mode installs the checkout into a venv llmgw owns, made with an
interpreter outside every home folder, and links /usr/local/bin/llmgw to it.

Each release is its own venv, /opt/llmgw/releases/VERSION-COMMIT-DIGEST/; the symlink
/opt/llmgw/current names the one in use and is swapped with rename(2), so a unit starts
either the old release or the new one, never half of each. The one before stays, named by
/opt/llmgw/previous, so an upgrade whose `pytest checks/` fails is rolled back (rollback()).
A venv made by an older llmgw straight in /opt/llmgw counts as a release named ".".
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import tempfile
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from llmgw.errors import Error
from llmgw.host.files import atomic_write

__all__ = [
    "LINK",
    "VENV",
    "InstallError",
    "Installed",
    "Release",
    "RolledBack",
    "checkout_release",
    "confirm_upgrade",
    "drift",
    "find_interpreter",
    "hidden_program",
    "install",
    "installed_release",
    "pending_upgrade",
    "rollback",
]

VENV = Path("/opt/llmgw")
LINK = Path("/usr/local/bin/llmgw")
RECORD_NAME = "llmgw-install.json"
# Written by an upgrade, removed once `pytest checks/` passes (or the upgrade is undone).
PENDING_NAME = "pending-upgrade.json"
# The distribution's interpreters first: they sit outside every home and get security fixes.
CANDIDATES = ("/usr/bin/python3.11", "/usr/bin/python3", "/usr/local/bin/python3.11",
              "/usr/local/bin/python3")
MIN_PYTHON = (3, 11)
HOMES = ("/root", "/home", "/run/user")
INSTALL_HINT = "apt-get install python3 python3-venv (Debian/Ubuntu; Python 3.11 or newer)"
# What a checkout ships into the venv (pyproject.toml names README.md as the readme; src/
# holds llmgw and its harness, llmgw_harness, for `llmgw check`); a change to
# pyproject.toml or a package folder is a new release, a change to the README is not.
PACKAGE_FILES = ("pyproject.toml", "README.md")
PACKAGE_DIRS = ("src",)
RELEASE_FILES = ("pyproject.toml",)
PIP_TIMEOUT_S = 600

Runner = Callable[[Sequence[str]], subprocess.CompletedProcess[str]]


class InstallError(Error):
    """llmgw could not be installed into /opt/llmgw; the message says what to do."""


@dataclass(frozen=True)
class Release:
    """One state of llmgw's code: its version, the commit it came from and a digest of
    the files it ships (so an uncommitted edit is a new release too)."""

    version: str
    commit: str
    digest: str

    def label(self) -> str:
        return f"{self.version} ({self.commit})" if self.commit else self.version


@dataclass(frozen=True)
class Installed:
    """What install() did: changed or not, what is there now and what was there before."""

    changed: bool
    release: Release
    previous: Release | None
    restarted: tuple[str, ...] = ()

    def line(self, venv: Path = VENV) -> str:
        if not self.changed:
            return f"llmgw {self.release.label()} in {venv}"
        was = f" (was {self.previous.label()})" if self.previous else ""
        restarted = f"; restarted {', '.join(self.restarted)}" if self.restarted else ""
        return f"llmgw {self.release.label()} installed in {venv}{was}{restarted}"


def _run(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=PIP_TIMEOUT_S,
                          check=False)


# --- facts ---

def _source_files(checkout: Path) -> list[Path]:
    files = [checkout / name for name in RELEASE_FILES if (checkout / name).is_file()]
    for folder in PACKAGE_DIRS:
        files += sorted(p for p in (checkout / folder).rglob("*")
                        if p.is_file() and "__pycache__" not in p.parts
                        and ".egg-info" not in str(p.relative_to(checkout)))
    return files


def _commit(checkout: Path) -> str:
    git = shutil.which("git")
    if not git or not (checkout / ".git").exists():
        return ""
    proc = subprocess.run([git, "-C", str(checkout), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=False)
    return proc.stdout.strip() if proc.returncode == 0 else ""


def checkout_release(checkout: Path) -> Release:
    """The release a checkout holds."""
    project = tomllib.loads((checkout / "pyproject.toml").read_text())["project"]
    h = hashlib.sha256()
    for path in _source_files(checkout):
        h.update(str(path.relative_to(checkout)).encode() + b"\0" + path.read_bytes() + b"\0")
    return Release(str(project["version"]), _commit(checkout), h.hexdigest())


def release_name(release: Release) -> str:
    """The folder a release is installed in, under releases/."""
    return f"{release.version}-{release.commit or 'uncommitted'}-{release.digest[:12]}"


def release_dir(root: Path, which: str) -> Path | None:
    """The release folder that root/current or root/previous names; for a venv made by an
    older llmgw straight in root, root itself as the current one."""
    target = link_target(root / which)
    if target is not None:
        return (root / target).resolve() if target != Path(".") else root
    if which == "current" and (root / RECORD_NAME).is_file():
        return root
    return None


def _record(folder: Path | None) -> Release | None:
    if folder is None:
        return None
    try:
        data = json.loads((folder / RECORD_NAME).read_text())
        return Release(data["version"], data["commit"], data["digest"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def installed_release(venv: Path = VENV, which: str = "current") -> Release | None:
    """The release in use under venv (or the previous one), from the record install()
    leaves in it; None when there is none."""
    return _record(release_dir(venv, which))


def pending_upgrade(venv: Path = VENV) -> tuple[Release, Release] | None:
    """(new, previous) of an upgrade not yet confirmed by `pytest checks/`; else None."""
    try:
        data = json.loads((venv / PENDING_NAME).read_text())
        return Release(**data["release"]), Release(**data["previous"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def confirm_upgrade(venv: Path = VENV) -> None:
    """The upgrade passed its checks: nothing is left to roll back."""
    (venv / PENDING_NAME).unlink(missing_ok=True)


def drift(checkout: Path, venv: Path = VENV, link: Path = LINK) -> str:
    """How the installed llmgw differs from the checkout's; '' when it is the same."""
    want = checkout_release(checkout)
    have = installed_release(venv)
    if have is None:
        return f"no llmgw is installed in {venv} (no {venv / 'current' / RECORD_NAME})"
    if link_target(link) != venv / "current" / "bin" / "llmgw":
        return (f"{link} points at {link_target(link) or 'nothing'}, not "
                f"{venv}/current/bin/llmgw")
    if have != want:
        return (f"the services run llmgw {have.label()} from {venv}, but the checkout "
                f"{checkout} holds {want.label()}"
                + (" with other files" if have.label() == want.label() else ""))
    return ""


def hidden_from_services(path: Path) -> str:
    """Why a service user could not execute path; '' when every user can."""
    real = path.resolve()
    if str(real).startswith(tuple(h + "/" for h in HOMES)):
        return f"{real} is under a home folder, which user llmgw and ProtectHome= cannot enter"
    for folder in real.parents:
        if not folder.stat().st_mode & stat.S_IXOTH:
            return f"{folder} (holding {real}) is not searchable by other users"
    if not real.stat().st_mode & stat.S_IXOTH:
        return f"{real} is not executable by other users"
    return ""


def hidden_program(program: Path) -> str:
    """Why a service user could not run program (or the interpreter its #! line names);
    '' when it can."""
    if not program.exists():
        return f"{program} does not exist"
    why = hidden_from_services(program)
    if why:
        return why
    with program.resolve().open("rb") as f:
        first = f.readline(512)
    if first.startswith(b"#!"):
        interpreter = Path(first[2:].split()[0].decode(errors="replace"))
        return hidden_from_services(interpreter) if interpreter.exists() else (
            f"{program} names {interpreter} as its interpreter, which does not exist")
    return ""


def _python_version(python: Path, run: Runner) -> tuple[int, int] | None:
    """(major, minor) of an interpreter that can make venvs with pip; None when it cannot."""
    proc = run([str(python), "-c",
                "import sys, venv, ensurepip; print(*sys.version_info[:2])"])
    if proc.returncode != 0:
        return None
    major, minor = proc.stdout.split()
    return int(major), int(minor)


def find_interpreter(candidates: Sequence[str] = CANDIDATES, run: Runner = _run) -> Path:
    """The first Python 3.11+ that every service user can execute and that makes venvs."""
    seen = []
    for name in candidates:
        path = Path(name)
        if not path.exists():
            continue
        why = hidden_from_services(path)
        if why:
            seen.append(why)
            continue
        version = _python_version(path, run)
        if version is None:
            seen.append(f"{path} lacks the venv module or ensurepip")
        elif version < MIN_PYTHON:
            seen.append(f"{path} is Python {version[0]}.{version[1]}")
        else:
            return path
    found = "; ".join(seen) or f"none of {', '.join(candidates)} exists"
    raise InstallError(
        f"no Python {MIN_PYTHON[0]}.{MIN_PYTHON[1]}+ that every service user can run was "
        f"found to make {VENV} ({found}); install one: {INSTALL_HINT}, then run again"
    )


def venv_interpreter(venv: Path) -> Path | None:
    """The interpreter a venv was made with (its pyvenv.cfg `executable`, or `home`)."""
    try:
        lines = (venv / "pyvenv.cfg").read_text().splitlines()
    except OSError:
        return None
    cfg = dict(line.split(" = ", 1) for line in lines if " = " in line)
    if "executable" in cfg:
        return Path(cfg["executable"])
    return Path(cfg["home"]) / "python3" if "home" in cfg else None


def link_target(link: Path = LINK) -> Path | None:
    try:
        return Path(os.readlink(link))
    except OSError:
        return None


# --- operations ---

def _check(proc: subprocess.CompletedProcess[str], what: str) -> None:
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip()[-1500:]
        raise InstallError(f"{what} failed ({proc.returncode}): {tail}")


def _make_venv(venv: Path, python: Path, run: Runner) -> None:
    # --clear: a venv made with another interpreter (one under /root) is remade, not patched.
    _check(run([str(python), "-m", "venv", "--clear", str(venv)]),
           f"{python} -m venv {venv} (is python3-venv installed? {INSTALL_HINT})")


def _pip_install(venv: Path, checkout: Path, run: Runner) -> None:
    # A copy of what the package ships, so the build never writes into the checkout
    # (build/, *.egg-info) and a checkout owned by another user still installs.
    with tempfile.TemporaryDirectory(prefix="llmgw-install-") as tmp:
        src = Path(tmp) / "llmgw"
        src.mkdir()
        for name in PACKAGE_FILES:
            if (checkout / name).is_file():
                shutil.copy2(checkout / name, src / name)
        for folder in PACKAGE_DIRS:
            if (checkout / folder).is_dir():
                shutil.copytree(checkout / folder, src / folder,
                                ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        # Dependencies already there are kept (only-if-needed), so an upgrade needs the
        # package index only for what changed; --force-reinstall of llmgw alone, since an
        # unchanged version number would otherwise be taken as installed already.
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
               "--disable-pip-version-check"]
        _check(run([*pip, str(src)]), f"pip install of {checkout} into {venv}")
        _check(run([*pip, "--no-deps", "--force-reinstall", str(src)]),
               f"pip install of {checkout} into {venv}")


def _swap_link(link: Path, target: Path) -> bool:
    """Point link at target with rename(2): whoever follows it sees the old target or the
    new one, never none. Returns whether it changed."""
    if link_target(link) == target:
        return False
    link.parent.mkdir(parents=True, exist_ok=True)
    tmp = link.with_name(f".{link.name}.tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    os.replace(tmp, link)
    return True


def _link(venv: Path, link: Path) -> bool:
    return _swap_link(link, venv / "current" / "bin" / "llmgw")


def _relative(venv: Path, folder: Path) -> Path:
    """How root/current names a release: relative, so the tree can be inspected anywhere."""
    return Path(".") if folder == venv else folder.resolve().relative_to(venv.resolve())


def _restart_running(units: Sequence[str], run: Runner) -> tuple[str, ...]:
    """Restart those of units that are running (they run the old code); the others are
    started by their own steps."""
    running = tuple(u for u in units
                    if run(["systemctl", "is-active", "--quiet", u]).returncode == 0)
    if running:
        _check(run(["systemctl", "restart", *running]), f"systemctl restart {' '.join(running)}")
    return running


def _usable(folder: Path | None) -> bool:
    made_with = venv_interpreter(folder) if folder is not None else None
    return made_with is not None and made_with.exists() and not hidden_from_services(made_with)


def _build(checkout: Path, release: Release, folder: Path, candidates: Sequence[str],
           run: Runner) -> None:
    """A venv at folder holding the checkout's release (kept when it already does)."""
    if _usable(folder) and _record(folder) == release:
        return  # a release installed before (the one rolled back from, say)
    _make_venv(folder, find_interpreter(candidates, run), run)
    _pip_install(folder, checkout, run)
    atomic_write(folder / RECORD_NAME, json.dumps(asdict(release), indent=2) + "\n")


def _prune(venv: Path) -> None:
    """Remove the releases that neither current nor previous names: two are kept."""
    keep = {release_dir(venv, "current"), release_dir(venv, "previous")}
    releases = venv / "releases"
    for folder in sorted(releases.iterdir()) if releases.is_dir() else []:
        if folder.resolve() not in keep:
            shutil.rmtree(folder, ignore_errors=True)


def install(
    checkout: Path,
    *,
    venv: Path = VENV,
    link: Path = LINK,
    units: Sequence[str] = (),
    candidates: Sequence[str] = CANDIDATES,
    run: Runner = _run,
) -> Installed:
    """Make venv/current hold the checkout's release and link point at its llmgw.

    Changes nothing when the current release is this one, made with an interpreter every
    service user can run, and the link is right. Otherwise the release is built in its own
    folder beside the current one, current is swapped to it and the one before is kept as
    previous; after an upgrade the running units among `units` are restarted, so they run
    the new code, and the upgrade is pending until confirm_upgrade() or rollback().
    """
    release = checkout_release(checkout)
    before = release_dir(venv, "current")
    previous = _record(before)
    if previous == release and _usable(before) and before != venv:
        return Installed(_link(venv, link), release, previous)
    folder = venv / "releases" / release_name(release)
    _build(checkout, release, folder, candidates, run)
    if before is not None and previous is not None and _usable(before):
        _swap_link(venv / "previous", _relative(venv, before))
    _swap_link(venv / "current", _relative(venv, folder))
    _link(venv, link)
    _prune(venv)
    if previous is None:
        return Installed(True, release, previous)
    if previous != release:
        atomic_write(venv / PENDING_NAME, json.dumps(
            {"release": asdict(release), "previous": asdict(previous)}, indent=2) + "\n")
    return Installed(True, release, previous, _restart_running(units, run))


@dataclass(frozen=True)
class RolledBack:
    """What rollback() did: the release undone, the one restored, the units restarted."""

    undone: Release
    restored: Release
    restarted: tuple[str, ...] = ()

    def line(self, venv: Path = VENV) -> str:
        restarted = f"; restarted {', '.join(self.restarted)}" if self.restarted else ""
        return (f"rolled back llmgw {self.undone.label()} to {self.restored.label()} in "
                f"{venv}{restarted}")


def rollback(
    *, venv: Path = VENV, link: Path = LINK, units: Sequence[str] = (), run: Runner = _run
) -> RolledBack:
    """Make the previous release current again and restart units (those that run llmgw)."""
    undone, back = _record(release_dir(venv, "current")), release_dir(venv, "previous")
    restored = _record(back)
    if undone is None or back is None or restored is None:
        raise InstallError(
            f"there is no previous release to restore in {venv} ({venv / 'previous'} names "
            f"{link_target(venv / 'previous') or 'nothing'}); install the release you want "
            "with `scripts/up` from its checkout")
    _swap_link(venv / "current", _relative(venv, back))
    (venv / "previous").unlink(missing_ok=True)  # never back onto the release undone
    _link(venv, link)
    confirm_upgrade(venv)
    # Every unit given, failed ones too: the release undone may be why they failed.
    if units:
        _check(run(["systemctl", "restart", *units]), f"systemctl restart {' '.join(units)}")
    return RolledBack(undone, restored, tuple(units))
