"""Files: atomic writes (a crash never leaves half a file), their modes, a log's last lines."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def file_mode(path: str | os.PathLike[str]) -> int | None:
    """path's permission bits (setuid, setgid and sticky too: 0o7777), None when it is
    missing."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        return None


def last_lines(path: str | os.PathLike[str], n: int) -> str:
    """The last n non-empty lines of a log, joined by ' | '; '' when it cannot be read."""
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return " | ".join(line.strip() for line in lines[-n:] if line.strip())


def atomic_write(path: str | os.PathLike[str], data: bytes | str, mode: int = 0o644) -> None:
    """Write data to path through a temporary file in the same folder, fsync and rename.

    A file written over keeps its owner and group (where we may set them): a key or a
    config shared with a service user stays readable by it after a rewrite.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    try:
        old = path.stat()
    except FileNotFoundError:
        old = None
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        if old is not None and os.geteuid() == 0:
            os.fchown(fd, old.st_uid, old.st_gid)
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dirfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dirfd)
    finally:
        os.close(dirfd)
