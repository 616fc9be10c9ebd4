"""A CUDA llama-server stood in for, on a machine without a GPU: the one copy that tests
and bench/gpu_fleet.py use.

It is a real executable (this Python) that answers `--list-devices` as llama.cpp's CUDA
build does, naming one card as CUDA0, and logs each replica it is asked to start (its
command line and CUDA_VISIBLE_DEVICES, one JSON line each). A start then either runs the
real CPU llama-server in its place, without the GPU flags a CPU build cannot honour, or
prints the lines given (llama.cpp's out-of-memory lines, say) and exits 1."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path

H100 = "NVIDIA H100 80GB HBM3 (81559 MiB, 80535 MiB free)"
H200 = "NVIDIA H200 (143771 MiB, 143000 MiB free)"


def standin_cuda_server(directory: Path, *, real: str | None = None, fails_with: str = "",
                        card: str = H100, visible: Iterable[str] | None = None
                        ) -> tuple[Path, Path]:
    """DIR/llama-server and the file it logs starts to (DIR/starts.jsonl). --list-devices
    names card as CUDA0; with visible, only when CUDA_VISIBLE_DEVICES is one of them (for
    another card it lists none, as for a card the driver cannot run). A start runs real
    without --device and --n-gpu-layers, or with real None writes fails_with to stderr and
    exits 1."""
    directory.mkdir(parents=True, exist_ok=True)
    engine, starts = directory / "llama-server", directory / "starts.jsonl"
    shown = None if visible is None else sorted(visible)
    engine.write_text(f"""#!{sys.executable}
import json, os, sys
argv = sys.argv[1:]
if argv[:1] == ["--list-devices"]:
    print("Available devices:")
    if {shown!r} is None or os.environ.get("CUDA_VISIBLE_DEVICES") in {shown!r}:
        print("  CUDA0: " + {card!r})
    sys.exit(0)
with open({str(starts)!r}, "a") as log:
    log.write(json.dumps({{"argv": argv, "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}}) + "\\n")
if {real!r} is None:
    sys.stderr.write({fails_with!r})
    sys.exit(1)
kept, words = [], iter(argv)
for word in words:
    if word in ("--device", "--n-gpu-layers"):
        next(words)
        continue
    kept.append(word)
os.execv({real!r}, [{real!r}, *kept])
""")
    engine.chmod(0o755)
    return engine, starts


def standin_rpc_server(directory: Path, *, real: str) -> tuple[Path, Path]:
    """DIR/rpc-server standing for the CUDA build's, and the file it logs starts to
    (DIR/rpc-starts.jsonl: its command line and CUDA_VISIBLE_DEVICES, one JSON line each).
    It then runs real (a CPU build's rpc-server) without --device, which names CUDA
    devices a CPU build does not have; as the CUDA build does for a device it cannot see,
    it exits 1 where --device names more CUDA devices than CUDA_VISIBLE_DEVICES holds."""
    directory.mkdir(parents=True, exist_ok=True)
    binary, starts = directory / "rpc-server", directory / "rpc-starts.jsonl"
    binary.write_text(f"""#!{sys.executable}
import json, os, sys
argv = sys.argv[1:]
visible = os.environ.get("CUDA_VISIBLE_DEVICES")
with open({str(starts)!r}, "a") as log:
    log.write(json.dumps({{"argv": argv, "cuda": visible}}) + "\\n")
kept, words = [], iter(argv)
for word in words:
    if word in ("-d", "--device"):
        named = next(words).split(",")
        have = [v for v in (visible or "").split(",") if v]
        if len(named) > len(have):
            sys.stderr.write("error: unknown device: CUDA%d\\n" % len(have))
            sys.exit(1)
        continue
    kept.append(word)
os.execv({real!r}, [{real!r}, *kept])
""")
    binary.chmod(0o755)
    return binary, starts
