"""The engine cache's layout, spelled once: where a node keeps what it builds, assembles and
downloads, outside any checkout and across restarts.

The root is `engine.cache_dir` from agent.yaml; provision writes /var/cache/llmgw there in
system mode and `${XDG_CACHE_HOME:-~/.cache}/llmgw` in local mode, which is also the
default of an agent.yaml without it:

    <root>/engines/llamacpp/<version>-rpc/llama-server    the CPU build, one static file,
    <root>/engines/llamacpp/<version>-rpc/rpc-server      with the RPC backend (GGML_RPC=ON)
    <root>/engines/llamacpp/<version>/llama-server        an earlier CPU build, without RPC
    <root>/engines/llamacpp/<version>/build.log           how it was built
    <root>/engines/llamacpp/<version>-cuda<major>-sm<archs>-rpc/  a CUDA build for these GPUs,
                                                          llama-server and rpc-server
    <root>/engines/llamacpp/<version>-cuda<major>-sm<archs>/      an earlier one, without RPC
    <root>/engines/llamacpp/.<dir>.lock                   one build of each at a time
    <root>/engines/xllamacpp/<version>/...                the prebuilt wheel (engines._prebuilt)
    <root>/cuda/...                                       CUDA toolchains (engines._toolchain)
    <root>/sources/llama_cpp_python-<version>.tar.gz      the downloaded source

Only the standard library: scripts/gpu-check reads it by path where llmgw is not installed.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

SYSTEM_ROOT = Path("/var/cache/llmgw")
BINARY = "llama-server"
RPC_SERVER = "rpc-server"
LLAMACPP = "llamacpp"


def user_root() -> Path:
    """`${XDG_CACHE_HOME:-~/.cache}/llmgw`: local mode's cache, and the default one."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "llmgw"


def root_for(mode: str) -> Path:
    """The cache provision gives an agent of this mode ("system" or "local")."""
    return SYSTEM_ROOT if mode == "system" else user_root()


def engines(root: Path) -> Path:
    """Every engine's builds and installs, one folder per engine."""
    return root / "engines"


def llamacpp_builds(root: Path) -> Path:
    """The llama.cpp builds, CPU and CUDA, one folder each."""
    return engines(root) / LLAMACPP


def cpu_build(root: Path, version: str, *, rpc: bool = False) -> Path:
    """The CPU build of the pinned version: its folder, holding llama-server (and
    rpc-server where rpc: <version>-rpc, so a build without RPC stays usable until it is
    made)."""
    return llamacpp_builds(root) / (f"{version}-rpc" if rpc else version)


def arch_tag(archs: Iterable[str]) -> str:
    """The architectures as a folder name: ["90", "80"] is sm90_80."""
    return "sm" + "_".join(archs)


def cuda_build(root: Path, version: str, archs: list[str], major: int, *,
               rpc: bool = False) -> Path:
    """The CUDA build of version for these architectures with this CUDA major:
    <root>/engines/llamacpp/<version>-cuda<major>-sm90_80/, and with rpc the one with the
    RPC backend, <version>-cuda<major>-sm90_80-rpc/ (a folder of its own, so a build from
    before it serves until it is made, as cpu_build's)."""
    name = f"{version}-cuda{major}-{arch_tag(archs)}"
    return llamacpp_builds(root) / (f"{name}-rpc" if rpc else name)


def prebuilt(root: Path, engine: str, version: str) -> Path:
    """A prebuilt engine's install: its venv, launcher and log."""
    return engines(root) / engine / version


def toolchains(root: Path) -> Path:
    """The CUDA toolchains assembled or completed here."""
    return root / "cuda"


def sources(root: Path) -> Path:
    return root / "sources"


def sdist(root: Path, version: str) -> Path:
    """The llama-cpp-python source archive of version, as pip downloads it."""
    return sources(root) / f"llama_cpp_python-{version}.tar.gz"


def lock_file(folder: Path) -> Path:
    """The lock beside folder that one build or install of it at a time holds."""
    return folder.parent / f".{folder.name}.lock"


def watched(root: Path) -> tuple[Path, ...]:
    """What a failed GPU engine watches for a change (a build removed, a toolkit added)."""
    return llamacpp_builds(root), toolchains(root)
