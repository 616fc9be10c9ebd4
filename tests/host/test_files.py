"""host/files.py: a file's mode as every check reads it (missing: None)."""

from __future__ import annotations

import os
from pathlib import Path

from llmgw.host.files import atomic_write, file_mode


def test_file_mode_is_the_permission_bits_and_none_when_missing(tmp_path: Path) -> None:
    path = tmp_path / "token"
    assert file_mode(path) is None, "a missing file has no mode"
    atomic_write(path, "x", mode=0o600)
    assert file_mode(path) == 0o600 and file_mode(str(path)) == 0o600
    os.chmod(path, 0o1640)  # the sticky bit counts: a mode of 1640 is not 0640
    assert file_mode(path) == 0o1640
