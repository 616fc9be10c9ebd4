"""The CUDA toolchain a GPU build uses: the system's toolkit, completed or assembled in the cache.

The choice, made by `find_toolchain`:
- CUDA 13 where the driver runs it (CUDA version 13.0 or later) and every GPU has compute
  capability 7.5 or more (CUDA 13 dropped the older ones), else CUDA 12.
- A system toolkit (`nvcc` on PATH or /usr/local/cuda) of a major the node can run, when it
  has nvcc, the runtime (cuda_runtime.h, libcudart), cuBLAS (cublas_v2.h, libcublas,
  libcublasLt) and CCCL (cub, thrust).
- Such a toolkit without cuBLAS or CCCL (as when it was assembled from nvcc wheels only)
  is completed from the package index's wheels, of its own major.minor, in the cache.
- Else, for CUDA 13, a whole toolkit assembled in the cache from the package index:
  `cuda-toolkit[nvcc,cudart,cublas,cccl]`, no newer than the driver's CUDA, which pins
  nvidia-cuda-nvcc, nvidia-cuda-crt, nvidia-nvvm, nvidia-cuda-runtime, nvidia-cublas
  (with nvidia-cuda-nvrtc) and nvidia-cuda-cccl, all sharing `nvidia/cu13/`.
- CUDA 12 cannot be assembled so: its wheels (nvidia-cuda-nvcc-cu12 and the rest, each in
  its own `nvidia/<pkg>/`) ship ptxas but no nvcc. A node that needs CUDA 12 and has no
  CUDA 12 toolkit is told what to install.

The wheels ship no unversioned libcudart.so / libcublas.so (the names CMake looks for) and
no libcuda stub: the links are made in the cache, and the build uses -DGGML_CUDA_NO_VMM=ON
so nothing links libcuda. The built server finds the libraries through its RPATH
(`Toolchain.library_dirs`).

    <cache_dir>/cuda/13/nvidia/cu13/{bin,include,lib,nvvm}    a toolkit assembled here
    <cache_dir>/cuda/13.0-cublas/nvidia/cu13/{include,lib}     parts completing a system 13.0
    <cache_dir>/cuda/<dir>.log                                 what pip said
"""

from __future__ import annotations

import fcntl
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from llmgw.agent.engines import cache
from llmgw.agent.gpus import Discovery
from llmgw.errors import Error
from llmgw.host.commands import CommandFailed, run_logged

PIP_TIMEOUT_S = 3600
VERSION_TIMEOUT_S = 60
CUDA13_MIN_CAPABILITY = (7, 5)
SYSTEM_ROOTS = (Path("/usr/local/cuda"),)
# The parts a build needs, and the cuda-toolkit extra that brings each.
EXTRAS = {"nvcc": "nvcc", "runtime": "cudart", "cuBLAS": "cublas", "CCCL": "cccl"}
# What the cache may add to a system toolkit (the rest must come with its nvcc).
COMPLETABLE = frozenset({"cuBLAS", "CCCL"})
_RELEASE = re.compile(r"release (\d+)\.(\d+)")
_VERSIONED_LIB = re.compile(r"^(lib[\w+-]+\.so)\.\d+(\.\d+)*$")

Pip = Callable[[list[str], Path], None]
"""pip(requirements, target): install the wheels into target (pip install --target)."""


class ToolchainError(Error):
    """No CUDA toolchain can be had here; the message says why and what to do (one line)."""


@dataclass(frozen=True)
class Toolchain:
    """What a CUDA build is given: nvcc, the include and library dirs beyond nvcc's own, the
    libraries found apart from nvcc's tree (CMake cache entries), and where the built
    server finds its CUDA libraries at run time (library_dirs, its RPATH)."""

    nvcc: Path
    major: int
    version: str
    root: Path
    origin: str
    include_dirs: tuple[Path, ...] = ()
    library_dirs: tuple[Path, ...] = ()
    libraries: tuple[tuple[str, Path], ...] = ()

    @property
    def rpath_dirs(self) -> tuple[Path, ...]:
        return self.library_dirs


def cuda_major(discovery: Discovery) -> int:
    """13 where the driver runs CUDA 13 and every GPU's compute capability is 7.5 or more,
    else 12; ToolchainError for a driver older than CUDA 12."""
    driver = _version(discovery.cuda_driver)
    if driver and driver < (12, 0):
        raise ToolchainError(
            f"the NVIDIA driver here ({discovery.driver_version or 'its version unknown'}) runs "
            f"CUDA {discovery.cuda_driver}, and llmgw builds llama.cpp for CUDA 12 or 13: "
            "update the driver (525 or later for CUDA 12, 580 or later for CUDA 13) and "
            "restart the agent")
    return 13 if not _why_not_13(discovery) else 12


def _why_not_13(discovery: Discovery) -> str:
    driver = _version(discovery.cuda_driver)
    if not driver:
        return "the driver's CUDA version is unknown"
    if driver < (13, 0):
        return f"the driver runs CUDA {discovery.cuda_driver}, not 13"
    for gpu in discovery.gpus:
        cc = _version(gpu.compute_capability)
        if not cc:
            return f"GPU {gpu.index}'s compute capability is unknown"
        if cc < CUDA13_MIN_CAPABILITY:
            return (f"GPU {gpu.index} ({gpu.name}) has compute capability "
                    f"{gpu.compute_capability}, which CUDA 13 no longer builds for")
    return ""


def _version(text: str) -> tuple[int, int] | None:
    m = re.match(r"^(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


# --- a toolkit's parts, wherever it lies ---


def _target_dir() -> str:
    """CUDA's name for this platform under targets/ (nvcc.profile's _TARGET_DIR_)."""
    return {"aarch64": "sbsa-linux", "arm64": "sbsa-linux"}.get(platform.machine(),
                                                                 "x86_64-linux")


def _include_dirs(root: Path) -> list[Path]:
    return [d for d in (root / "include", root / "targets" / _target_dir() / "include")
            if d.is_dir()]


def _lib_dirs(root: Path) -> list[Path]:
    candidates = (root / "lib64", root / "lib", root / "targets" / _target_dir() / "lib",
                  root / "lib" / f"{platform.machine()}-linux-gnu")
    return [d for d in candidates if d.is_dir()]


def _find(dirs: Iterable[Path], *names: str) -> Path | None:
    """The first dir holding every one of names."""
    return next((d for d in dirs if all((d / n).exists() for n in names)), None)


@dataclass(frozen=True)
class _Parts:
    """Where each part of a toolkit is (None: missing)."""

    nvcc: Path | None
    runtime_h: Path | None
    runtime_lib: Path | None
    cublas_h: Path | None
    cublas_lib: Path | None
    cccl: Path | None

    def missing(self) -> list[str]:
        have = {"nvcc": self.nvcc, "runtime": self.runtime_h and self.runtime_lib,
                "cuBLAS": self.cublas_h and self.cublas_lib, "CCCL": self.cccl}
        return [part for part, where in have.items() if not where]


def _parts(root: Path, nvcc: Path | None = None) -> _Parts:
    includes, libs = _include_dirs(root), _lib_dirs(root)
    nvcc = nvcc or (root / "bin" / "nvcc")
    return _Parts(
        nvcc=nvcc if nvcc.is_file() and os.access(nvcc, os.X_OK) else None,
        runtime_h=_find(includes, "cuda_runtime.h"),
        runtime_lib=_find(libs, "libcudart.so"),
        cublas_h=_find(includes, "cublas_v2.h"),
        cublas_lib=_find(libs, "libcublas.so", "libcublasLt.so"),
        # CUDA 13 keeps CCCL under include/cccl (nvcc.profile adds it); CUDA 12 in include/.
        cccl=_find([*includes, *(d / "cccl" for d in includes)], "cub/cub.cuh"),
    )


def nvcc_version(nvcc: Path) -> tuple[int, int] | None:
    """(major, minor) from `nvcc --version` ("Cuda compilation tools, release 13.0, ...")."""
    try:
        proc = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True,
                              check=False, timeout=VERSION_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = _RELEASE.search(proc.stdout + proc.stderr)
    return (int(m.group(1)), int(m.group(2))) if m else None


# --- the system's toolkit ---


@dataclass(frozen=True)
class SystemToolkit:
    root: Path
    nvcc: Path
    version: tuple[int, int] | None
    parts: _Parts = field(repr=False)

    @property
    def name(self) -> str:
        version = f"CUDA {self.version[0]}.{self.version[1]} " if self.version else "CUDA "
        return f"the {version}toolkit at {self.root}"


def system_toolkit(search_path: str | None = None,
                   roots: Iterable[Path] = SYSTEM_ROOTS) -> SystemToolkit | None:
    """The toolkit of `nvcc` on PATH, else of the first root with bin/nvcc; None if none."""
    found = shutil.which("nvcc", path=search_path)
    candidates = [Path(found)] if found else []
    candidates += [r / "bin" / "nvcc" for r in roots]
    for nvcc in candidates:
        if nvcc.is_file():
            root = nvcc.resolve().parent.parent
            return SystemToolkit(root, nvcc, nvcc_version(nvcc), _parts(root, nvcc))
    return None


def _system_unfit(system: SystemToolkit, discovery: Discovery) -> str:
    """Why the node cannot run what this toolkit builds ('' when it can)."""
    if system.version is None:
        return f"`{system.nvcc} --version` names no CUDA release"
    major = system.version[0]
    driver = _version(discovery.cuda_driver)
    if major < 12:
        return f"{system.name} is older than CUDA 12"
    if driver and major > driver[0]:
        return f"{system.name} is newer than the driver's CUDA {discovery.cuda_driver}"
    if major >= 13 and _why_not_13(discovery):
        return f"{system.name} is CUDA 13, and {_why_not_13(discovery)}"
    return ""


def _system_toolchain(system: SystemToolkit) -> Toolchain:
    assert system.version is not None
    parts = system.parts
    libs = _unique([parts.runtime_lib, parts.cublas_lib])
    return Toolchain(system.nvcc, system.version[0], _dotted(system.version), system.root,
                     f"system ({system.name})", library_dirs=libs)


# --- what the cache adds ---


def find_toolchain(cache_dir: Path, discovery: Discovery, *, pip: Pip | None = None,
                   search_path: str | None = None, roots: Iterable[Path] = SYSTEM_ROOTS,
                   on_progress: Callable[[str], None] = lambda line: None) -> Toolchain:
    """The toolchain for this node's GPUs (module docstring); ToolchainError says why none."""
    pip = pip or pip_install
    major = cuda_major(discovery)
    system = system_toolkit(search_path, roots)
    passed_over = ""
    if system is not None:
        unfit = _system_unfit(system, discovery)
        missing = system.parts.missing()
        if not unfit and not missing:
            return _system_toolchain(system)
        if not unfit and set(missing) <= COMPLETABLE:
            return _completed(system, missing, cache.toolchains(cache_dir), pip, on_progress)
        passed_over = unfit or f"{system.name} lacks {_and(missing)}"
    if major == 13:
        return _assembled(cache.toolchains(cache_dir), discovery, pip, on_progress, passed_over)
    raise ToolchainError(_no_cuda12(discovery, passed_over))


def _no_cuda12(discovery: Discovery, passed_over: str) -> str:
    here = f"; {passed_over}" if passed_over else "; there is no CUDA toolkit here"
    driver = _version(discovery.cuda_driver)
    toolkit = f"{driver[0]}-{driver[1]}" if driver and driver[0] == 12 else "12-8"
    return (f"this node needs CUDA 12 ({_why_not_13(discovery)}){here}, and the package index "
            "has no CUDA 12 compiler to assemble one from (nvidia-cuda-nvcc-cu12 ships ptxas, "
            f"no nvcc): install NVIDIA's CUDA 12 toolkit (`apt-get install cuda-toolkit-{toolkit}` "
            "from NVIDIA's repository), or a driver for CUDA 13 (580 or later) where every GPU "
            "has compute capability 7.5 or more, then restart the agent")


def _completed(system: SystemToolkit, missing: list[str], cuda_dir: Path, pip: Pip,
               on_progress: Callable[[str], None]) -> Toolchain:
    """The system toolkit with cuBLAS and/or CCCL from wheels of its own major.minor."""
    assert system.version is not None
    major, minor = system.version
    names = "-".join(EXTRAS[p] for p in missing)
    target = cuda_dir / f"{major}.{minor}-{names}"
    requirement = _requirement(missing, f">={major}.{minor},<{major}.{minor + 1}")
    on_progress(f"CUDA toolchain: {system.name} lacks {_and(missing)}; installing "
                f"{requirement} into {target}")
    _installed(target, [requirement], pip)
    roots = _wheel_roots(target)
    extra = _parts_of(roots)
    still = [p for p in missing if not _has(extra, p)]
    if still:
        shutil.rmtree(target, ignore_errors=True)  # so the next start tries again
        raise ToolchainError(
            f"{system.name} lacks {_and(missing)}, and {requirement} from the package index "
            f"did not bring {_and(still)}; check the package index this machine uses (pip's "
            "config), or install them with the toolkit, then restart the agent")
    includes = _unique([extra.cublas_h if "cuBLAS" in missing else None,
                        extra.cccl if "CCCL" in missing else None])
    libs = _unique([system.parts.runtime_lib,
                    extra.cublas_lib if "cuBLAS" in missing else system.parts.cublas_lib])
    entries: tuple[tuple[str, Path], ...] = ()
    if "cuBLAS" in missing and extra.cublas_lib is not None:
        entries = tuple((f"CUDA_{name}_LIBRARY", extra.cublas_lib / f"lib{name}.so")
                        for name in ("cublas", "cublasLt"))
    return Toolchain(system.nvcc, major, _dotted(system.version), system.root,
                     f"system ({system.name}) with {_and(missing)} from {target}",
                     includes, libs, entries)


def _assembled(cuda_dir: Path, discovery: Discovery, pip: Pip,
               on_progress: Callable[[str], None], passed_over: str) -> Toolchain:
    """A whole CUDA 13 toolkit from wheels, no newer than the driver's CUDA."""
    driver = _version(discovery.cuda_driver) or (13, 0)
    target = cuda_dir / "13"
    requirement = _requirement(list(EXTRAS), f">=13.0,<13.{driver[1] + 1}")
    why = f" ({passed_over})" if passed_over else ""
    on_progress(f"CUDA toolchain: assembling CUDA 13 from the package index into {target}{why}")
    _installed(target, [requirement], pip)
    root = target / "nvidia" / "cu13"
    _link_toolkit_tree(root)
    parts = _parts(root)
    if parts.missing():
        shutil.rmtree(target, ignore_errors=True)  # so the next start tries again
        raise ToolchainError(
            f"{requirement} from the package index brought no {_and(parts.missing())}; check "
            "the package index this machine uses (pip's config), or install the CUDA toolkit, "
            "then restart the agent")
    assert parts.nvcc is not None
    version = nvcc_version(parts.nvcc)
    if version is None:
        raise ToolchainError(f"{parts.nvcc} --version does not answer; remove {target} and "
                             "restart the agent to install it again")
    return Toolchain(parts.nvcc, version[0], _dotted(version), root, f"cache ({target})",
                     library_dirs=_unique([parts.runtime_lib, parts.cublas_lib]))


def _requirement(parts: list[str], version: str) -> str:
    return f"cuda-toolkit[{','.join(EXTRAS[p] for p in parts)}]{version}"


def _installed(target: Path, requirements: list[str], pip: Pip) -> None:
    """The wheels in target, installed once (a marker written after pip succeeded)."""
    marker = target / ".llmgw-installed"
    if marker.exists():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(cache.lock_file(target), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists():  # another build installed it while this one waited
            return
        tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            pip(requirements, tmp)
            _link_versioned_libs(tmp)
            (tmp / marker.name).write_text("\n".join(requirements) + "\n")
            shutil.rmtree(target, ignore_errors=True)
            tmp.replace(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _wheel_roots(target: Path) -> list[Path]:
    """The toolkit roots wheels made: nvidia/cu13 (CUDA 13) or each nvidia/<pkg> (CUDA 12)."""
    return sorted(d for d in (target / "nvidia").glob("*") if d.is_dir())


def _parts_of(roots: list[Path]) -> _Parts:
    found = [_parts(r) for r in roots]
    return _Parts(
        nvcc=next((p.nvcc for p in found if p.nvcc), None),
        runtime_h=next((p.runtime_h for p in found if p.runtime_h), None),
        runtime_lib=next((p.runtime_lib for p in found if p.runtime_lib), None),
        cublas_h=next((p.cublas_h for p in found if p.cublas_h), None),
        cublas_lib=next((p.cublas_lib for p in found if p.cublas_lib), None),
        cccl=next((p.cccl for p in found if p.cccl), None),
    )


def _has(parts: _Parts, part: str) -> bool:
    return part not in parts.missing()


def _link_versioned_libs(tree: Path) -> None:
    """libX.so -> libX.so.N beside every versioned library the wheels shipped alone."""
    for lib in sorted(tree.glob("nvidia/*/lib*/lib*.so.*")):
        m = _VERSIONED_LIB.match(lib.name)
        if m and not (lib.parent / m.group(1)).exists():
            (lib.parent / m.group(1)).symlink_to(lib.name)


def _link_toolkit_tree(root: Path) -> None:
    """The links nvcc.profile and CMake expect of a toolkit: targets/<platform>/{include,lib}
    (nvcc.profile's -I and -L) and lib64 (FindCUDAToolkit's first guess)."""
    target = root / "targets" / _target_dir()
    target.mkdir(parents=True, exist_ok=True)
    for name in ("include", "lib"):
        if not (target / name).exists():
            (target / name).symlink_to(Path("..") / ".." / name)
    if not (root / "lib64").exists():
        (root / "lib64").symlink_to("lib")


def pip_install(requirements: list[str], target: Path) -> None:
    """pip install --target, wheels only; ToolchainError with pip's last lines if it fails."""
    log = target.parent / f"{target.name.lstrip('.').split('.tmp-')[0]}.log"
    cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-input",
           "--only-binary", ":all:", "--target", str(target), *requirements]
    wanted = " ".join(requirements)
    try:
        run_logged(cmd, what=f"pip installing {wanted}", log=log, timeout_s=PIP_TIMEOUT_S)
    except CommandFailed as e:
        if e.returncode is None:  # ran past its time
            raise ToolchainError(e.told()) from None
        raise ToolchainError(
            f"pip could not install {wanted} ({e.returncode}: {e.tail}); the whole log is "
            f"{log}. Check the package index this machine uses (pip's config), or install the "
            "CUDA toolkit, then restart the agent") from None


def _unique(dirs: Iterable[Path | None]) -> tuple[Path, ...]:
    return tuple(dict.fromkeys(d for d in dirs if d is not None))


def _dotted(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


def _and(items: list[str]) -> str:
    return " and ".join(items) if len(items) < 3 else ", ".join(items[:-1]) + f" and {items[-1]}"
