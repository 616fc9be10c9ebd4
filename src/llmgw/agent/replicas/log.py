"""Engine logs: size-capped by copy-and-truncate, tailed for the heartbeat, pruned late.

llama-server writes its own log through a file descriptor opened for appending, which
outlives the agent (engines are adopted). So the agent cannot swap the file under it:
it copies the log to ID.log.1 and truncates ID.log in place (logrotate's copytruncate);
the engine's next append lands at the start of the emptied file.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

MAX_BYTES = 8 << 20
# What each heartbeat carries per replica for `llmgw logs`: bounded in lines and bytes.
TAIL_LINES = 200
TAIL_BYTES = 32 << 10
# The control plane forgets a stopped replica after an hour; its log goes then too.
KEEP_STOPPED_S = 3600.0

# llama.cpp's own lines for a start that failed, in two kinds, most telling first in each:
# what broke on the device (ggml-cuda.cu: `..._alloc_buffer: allocating 15316.00 MiB on
# device 0: cudaMalloc failed: out of memory`; `CUDA error: ...`; ggml-alloc.c: `failed to
# allocate CUDA0 buffer of size N`), and the model load that failed for it (llama.cpp:
# `llama_model_load: error loading model: unable to allocate CUDA0 buffer`, `failed to
# load model`).
_FAILURE_KINDS = (
    (re.compile(r"cudaMalloc failed: "), re.compile(r"CUDA error: "),
     re.compile(r"failed to allocate \S+ buffer")),
    (re.compile(r"error loading model: "), re.compile(r"failed to load model")),
)


def rotate(path: Path, max_bytes: int = MAX_BYTES) -> bool:
    """Keep path under max_bytes, with one older generation beside it; True if rotated."""
    try:
        if path.stat().st_size <= max_bytes:
            return False
    except OSError:
        return False
    shutil.copyfile(path, path.with_name(path.name + ".1"))
    os.truncate(path, 0)
    return True


def tail(path: Path, lines: int = TAIL_LINES, max_bytes: int = TAIL_BYTES) -> list[str]:
    """The last lines of a log (the rotated generation too when the log was just emptied)."""
    data = b""
    for part in (path, path.with_name(path.name + ".1")):
        if len(data) >= max_bytes:
            break
        try:
            with open(part, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - (max_bytes - len(data))))
                data = f.read() + data
        except OSError:
            continue
    text = data[-max_bytes:].decode(errors="replace")
    return text.splitlines()[-lines:]


def tails(folder: Path) -> dict[str, list[str]]:
    """Every replica log in folder, by replica id."""
    return {p.name.removesuffix(".log"): tail(p) for p in sorted(folder.glob("*.log"))}


def prune(folder: Path, live: set[str], now: float | None = None,
          keep_s: float = KEEP_STOPPED_S) -> list[str]:
    """Remove the logs of replicas no longer run here once untouched for keep_s."""
    now = time.time() if now is None else now
    removed = []
    for path in sorted(folder.glob("*.log*")):
        rid = path.name.split(".log", 1)[0]
        try:
            old = now - path.stat().st_mtime > keep_s
        except OSError:
            continue
        if rid not in live and old:
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


def failure_reason(lines: list[str]) -> str:
    """Why an engine that exited failed to start, in llama.cpp's own words: the last line
    of the most telling pattern of each kind its log has (what broke on the device, then
    the model load it failed), joined by ' / '; '' when it has none."""
    found = []
    for kind in _FAILURE_KINDS:
        for pattern in kind:
            hits = [line.strip() for line in lines if pattern.search(line)]
            if hits:
                found.append(hits[-1])
                break
    return " / ".join(found)
