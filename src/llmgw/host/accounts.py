"""The system user services run as, and the files shared with it (system mode)."""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import subprocess
from pathlib import Path

from llmgw.errors import Error

USER = "llmgw"


class AccountError(Error):
    """The service user could not be made, or a file could not be shared with it."""


def ensure_user(name: str = USER) -> bool:
    """Create the system user (and its group) when missing; whether it was created."""
    try:
        pwd.getpwnam(name)
        return False
    except KeyError:
        pass
    useradd = shutil.which("useradd") or "/usr/sbin/useradd"
    proc = subprocess.run(
        [useradd, "--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent",
         "--shell", "/usr/sbin/nologin", name],
        capture_output=True, text=True, check=False,
    )
    if proc.returncode != 0:
        raise AccountError(f"useradd {name} failed ({proc.returncode}): {proc.stderr.strip()}; "
                           f"create the system user {name} by hand and run again")
    return True


def ensure_access(path: Path, *, owner: str, group: str, mode: int) -> bool:
    """Give path this owner, group and mode; whether anything changed."""
    uid, gid = pwd.getpwnam(owner).pw_uid, grp.getgrnam(group).gr_gid
    st = path.stat()
    changed = False
    if (st.st_uid, st.st_gid) != (uid, gid):
        os.chown(path, uid, gid)
        changed = True
    if st.st_mode & 0o7777 != mode:
        path.chmod(mode)
        changed = True
    return changed


def user_exists(name: str = USER) -> bool:
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


def user_name(uid: int) -> str:
    """The user's name, or the uid as text when it has none."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)
