"""A GGUF file's `general.name`, read from its header (no dependency: a few hundred bytes)."""

from __future__ import annotations

import re
import struct
from pathlib import Path
from typing import BinaryIO

from llmgw.errors import Error

MAGIC = b"GGUF"
# Value types of the GGUF spec (ggml/docs/gguf.md): fixed sizes, and the two that vary.
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
# general.* keys come first in every writer's output; a name past this many keys is absent.
_MAX_KEYS = 64


class GGUFError(Error):
    """The file is not a GGUF file this reader understands."""


def general_name(path: str | Path) -> str:
    """The file's `general.name` metadata; '' when it has none."""
    with open(path, "rb") as f:
        kv_count = _header(f, Path(path))
        for _ in range(min(kv_count, _MAX_KEYS)):
            key = _string(f)
            kind = _u32(f)
            if key == "general.name" and kind == _STRING:
                return _string(f)
            _skip(f, kind)
    return ""


def catalog_name(name: str) -> str:
    """name as a catalog name: lower case, runs of other characters as one '-' ('' if none
    is left). "Gemma 3 1B IT" -> "gemma-3-1b-it"."""
    return re.sub(r"[^a-z0-9._]+", "-", name.lower()).strip("-._")[:128]


def _header(f: BinaryIO, path: Path) -> int:
    magic = f.read(4)
    if magic != MAGIC:
        raise GGUFError(f"{path} starts with {magic!r}, not {MAGIC!r}, so it is not a GGUF "
                        "model file; give a .gguf file")
    version = _u32(f)
    if version < 2:  # version 1 used 32-bit counts; no current writer makes it
        raise GGUFError(f"{path} is GGUF version {version}; convert it with a current llama.cpp")
    _u64(f)  # tensor count
    return _u64(f)


def _skip(f: BinaryIO, kind: int) -> None:
    if kind == _STRING:
        f.seek(_u64(f), 1)
    elif kind == _ARRAY:
        item, count = _u32(f), _u64(f)
        if item in _FIXED:
            f.seek(_FIXED[item] * count, 1)
        else:
            for _ in range(count):
                _skip(f, item)
    elif kind in _FIXED:
        f.seek(_FIXED[kind], 1)
    else:
        raise GGUFError(f"{f.name} has a metadata value of unknown type {kind}")


def _string(f: BinaryIO) -> str:
    return _exact(f, _u64(f)).decode("utf-8", errors="replace")


def _u32(f: BinaryIO) -> int:
    return int(struct.unpack("<I", _exact(f, 4))[0])


def _u64(f: BinaryIO) -> int:
    return int(struct.unpack("<Q", _exact(f, 8))[0])


def _exact(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise GGUFError(f"{f.name} ends inside its metadata header: it is cut short")
    return data
