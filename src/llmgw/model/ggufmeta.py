"""A GGUF file's `general.name` and KV-cache geometry, read from its header (no dependency)."""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Literal, Protocol

from llmgw.contract.records import Geometry
from llmgw.errors import Error

MAGIC = b"GGUF"
# Value types of the GGUF spec (ggml/docs/gguf.md): fixed sizes, and the two that vary.
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
# general.* keys come first in every writer's output; a name past this many keys is absent.
_MAX_KEYS = 64
# Integer value types and their struct codes: u8 i8 u16 i16 u32 i32 bool u64 i64.
_INTS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 7: "<?", 10: "<Q", 11: "<q"}
# `<arch>.` keys that make the geometry, and their names in it (Geometry's keys).
_GeometryKey = Literal["block_count", "context_length", "embedding_length", "head_count",
                       "head_count_kv", "key_length", "value_length",
                       "feed_forward_length"]
_GEOMETRY_KEYS: dict[str, _GeometryKey] = {
    "block_count": "block_count",
    "context_length": "context_length",
    "embedding_length": "embedding_length",
    "attention.head_count": "head_count",
    "attention.head_count_kv": "head_count_kv",
    "attention.key_length": "key_length",
    "attention.value_length": "value_length",
    "feed_forward_length": "feed_forward_length",
}


class _Source(Protocol):
    @property
    def name(self) -> str: ...

    def read(self, n: int) -> bytes: ...

    def seek(self, offset: int, whence: int) -> int: ...


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


def geometry(path: str | Path) -> Geometry:
    """The file's KV-cache geometry (see `read_geometry`)."""
    with open(path, "rb") as f:
        return read_geometry(f, Path(path))


def read_geometry(f: _Source, where: str | Path) -> Geometry:
    """block_count, context_length, embedding_length, feed_forward_length,
    attention.head_count(_kv) and attention.key/value_length of the file's architecture, as
    far as it states them. A per-layer array (some architectures vary heads by layer)
    counts as its largest value. Reading stops at the tokenizer's keys, which come after
    these in every writer's output and hold most of a header's bytes."""
    kv_count = _header(f, Path(where))
    arch, found = "", Geometry()
    for _ in range(kv_count):
        key, kind = _string(f), _u32(f)
        if key == "general.architecture" and kind == _STRING:
            arch = _string(f)
            continue
        name = _GEOMETRY_KEYS.get(key[len(arch) + 1:]) if arch and key.startswith(arch + ".") \
            else None
        if name is None:
            if key.startswith("tokenizer.") and arch:
                break
            _skip(f, kind)
            continue
        value = _largest_int(f, kind)
        if value is not None:
            found[name] = value
    return found


def _largest_int(f: _Source, kind: int) -> int | None:
    """An integer value, or the largest of an array of them; None (skipped) otherwise."""
    if kind in _INTS:
        return int(struct.unpack(_INTS[kind], _exact(f, struct.calcsize(_INTS[kind])))[0])
    if kind == _ARRAY:
        item, count = _u32(f), _u64(f)
        if item in _INTS:
            size = struct.calcsize(_INTS[item])
            values = [int(struct.unpack(_INTS[item], _exact(f, size))[0]) for _ in range(count)]
            return max(values, default=0)
        for _ in range(count):
            _skip(f, item)
        return None
    _skip(f, kind)
    return None


class ChunkReader:
    """A file-like view of byte chunks (an HTTP body) for read_geometry: seeking forward
    reads and drops, and at most `limit` bytes are read."""

    def __init__(self, chunks: Iterator[bytes], name: str, limit: int) -> None:
        self.name = name
        self._chunks = chunks
        self._buffer = b""
        self._left = limit

    def read(self, n: int) -> bytes:
        while len(self._buffer) < n and self._left > 0:
            chunk = next(self._chunks, b"")
            if not chunk:
                break
            chunk = chunk[: self._left]
            self._left -= len(chunk)
            self._buffer += chunk
        data, self._buffer = self._buffer[:n], self._buffer[n:]
        return data

    def seek(self, offset: int, whence: int) -> int:
        if whence != 1 or offset < 0:
            raise GGUFError(f"{self.name}: a header read over the network only goes forward")
        while offset > 0:
            got = len(self.read(min(offset, 1 << 20)))
            if not got:
                break
            offset -= got
        return 0


def catalog_name(name: str) -> str:
    """name as a catalog name: lower case, runs of other characters as one '-' ('' if none
    is left). "Gemma 3 1B IT" -> "gemma-3-1b-it"."""
    return re.sub(r"[^a-z0-9._]+", "-", name.lower()).strip("-._")[:128]


def _header(f: _Source, path: Path) -> int:
    magic = f.read(4)
    if magic != MAGIC:
        raise GGUFError(f"{path} starts with {magic!r}, not {MAGIC!r}, so it is not a GGUF "
                        "model file; give a .gguf file")
    version = _u32(f)
    if version < 2:  # version 1 used 32-bit counts; no current writer makes it
        raise GGUFError(f"{path} is GGUF version {version}; convert it with a current llama.cpp")
    _u64(f)  # tensor count
    return _u64(f)


def _skip(f: _Source, kind: int) -> None:
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


def _string(f: _Source) -> str:
    return _exact(f, _u64(f)).decode("utf-8", errors="replace")


def _u32(f: _Source) -> int:
    return int(struct.unpack("<I", _exact(f, 4))[0])


def _u64(f: _Source) -> int:
    return int(struct.unpack("<Q", _exact(f, 8))[0])


def _exact(f: _Source, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise GGUFError(f"{f.name} ends inside its metadata header: it is cut short")
    return data
