"""Changes to the host as data, the one set: a file written, a folder made, a mode, owner or
name changed, a system user added, a command run. Each says what it would do, one line
each and read only (`lines`), and does it (`apply`). The service managers plan with them
(llmgw.host.services' `plan_*`); the harness's fixes yield them, and its --plan renders them
(llmgw_harness._changes, which adds the changes that need a host or an API).

`h`, where given, is the host a fix runs on; these changes need none.
"""

from __future__ import annotations

import difflib
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from llmgw.host import accounts
from llmgw.host.files import atomic_write, file_mode

# The arguments accounts.ensure_user gives useradd (a test holds the two the same).
USERADD_ARGS = ("--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent",
                "--shell", "/usr/sbin/nologin")


def _mode(mode: int) -> str:
    return f"{mode:04o}"


def _current(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


@dataclass(frozen=True)
class WriteFile:
    """path holds content with mode, written atomically; backup: the old file kept there
    first. secret: its content (a key, a token) is never shown, only its size."""

    path: Path
    content: str | bytes
    mode: int = 0o644
    secret: bool = False
    backup: Path | None = None
    then: str = ""
    # What the content is, said instead of its size when it is made afresh by each run
    # (a certificate, whose signature varies in length): the same plan reads the same.
    what: str = ""

    @property
    def data(self) -> bytes:
        return self.content.encode() if isinstance(self.content, str) else self.content

    def lines(self, h: object = None) -> list[str]:
        old = _current(self.path)
        kept = [f"keep the old {self.path} as {self.backup}"] if self.backup and old else []
        if old is None:
            return [f"create {self.path} ({self._size()}, mode {_mode(self.mode)})"]
        if old == self.data:
            same = file_mode(self.path) == self.mode
            return [] if same else [f"chmod {self.mode:o} {self.path}"]
        if self.secret or self.what or not _is_text(old) or not _is_text(self.data):
            return [*kept, f"write {self.path} ({self._size()}, mode {_mode(self.mode)})"]
        diff = difflib.unified_diff(old.decode().splitlines(), self.data.decode().splitlines(),
                                    str(self.path), f"{self.path} (mode {_mode(self.mode)})",
                                    lineterm="")
        return [*kept, *diff]

    def _size(self) -> str:
        if self.what:
            return self.what
        if self.secret:
            return f"secret, {len(self.data)} bytes"
        if not _is_text(self.data):
            return f"{len(self.data)} bytes"
        n = len(self.data.decode().splitlines())
        return f"{n} line{'s' if n != 1 else ''}"

    def apply(self, h: object = None) -> None:
        old = _current(self.path)
        if self.backup and old is not None:
            atomic_write(self.backup, old, mode=file_mode(self.path) or self.mode)
        atomic_write(self.path, self.data, mode=self.mode)


def _is_text(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


@dataclass(frozen=True)
class Chmod:
    path: Path
    mode: int
    then: str = ""

    def lines(self, h: object = None) -> list[str]:
        return [f"chmod {self.mode:o} {self.path}"]

    def apply(self, h: object = None) -> None:
        self.path.chmod(self.mode)


@dataclass(frozen=True)
class Mkdir:
    """path is a folder (its parents made too); nothing when it is one already."""

    path: Path
    then: str = ""

    def lines(self, h: object = None) -> list[str]:
        return [] if self.path.is_dir() else [f"mkdir -p {self.path}"]

    def apply(self, h: object = None) -> None:
        self.path.mkdir(parents=True, exist_ok=True)


@dataclass(frozen=True)
class Rename:
    """source moved to target (an old certificate kept beside, never deleted)."""

    source: Path
    target: Path
    then: str = ""

    def lines(self, h: object = None) -> list[str]:
        return [f"mv {self.source} {self.target}"]

    def apply(self, h: object = None) -> None:
        self.source.rename(self.target)


@dataclass(frozen=True)
class Chown:
    """path has this owner, group and mode; only what differs is changed (and shown)."""

    path: Path
    owner: str
    group: str
    mode: int | None = None  # None: the mode is left as it is
    then: str = ""

    def lines(self, h: object = None) -> list[str]:
        try:
            st = self.path.stat()
            owner, group = accounts.user_name(st.st_uid), accounts.group_name(st.st_gid)
            mode: int | None = st.st_mode & 0o7777
        except FileNotFoundError:
            owner = group = ""
            mode = None
        said = [] if (owner, group) == (self.owner, self.group) else [
            f"chown {self.owner}:{self.group} {self.path}"]
        if self.mode is None or mode == self.mode:
            return said
        return [*said, f"chmod {self.mode:o} {self.path}"]

    def apply(self, h: object = None) -> None:
        mode = self.mode if self.mode is not None else self.path.stat().st_mode & 0o7777
        accounts.ensure_access(self.path, owner=self.owner, group=self.group, mode=mode)


@dataclass(frozen=True)
class SystemUser:
    """The system user (and its group) exists; useradd when it does not."""

    name: str
    then: str = ""

    def lines(self, h: object = None) -> list[str]:
        if accounts.user_exists(self.name):
            return []
        useradd = shutil.which("useradd") or "/usr/sbin/useradd"  # as accounts finds it
        return [shlex.join([useradd, *USERADD_ARGS, self.name])]

    def apply(self, h: object = None) -> None:
        accounts.ensure_user(self.name)


@dataclass(frozen=True)
class Run:
    """Any other command, as its argv (never a shell string)."""

    argv: tuple[str, ...]
    then: str = ""

    def lines(self, h: object = None) -> list[str]:
        return [shlex.join(self.argv)]

    def apply(self, h: object = None) -> None:
        subprocess.run(list(self.argv), check=True, capture_output=True)
