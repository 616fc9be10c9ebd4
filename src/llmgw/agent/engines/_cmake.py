"""The CMake command lines of a llama-server build: configured for CPU or for CUDA, built,
at the lowest priority, with as many jobs as cores and memory allow. Both builds have
llama.cpp's RPC backend (GGML_RPC=ON) and build rpc-server beside llama-server: the two
ends of one model split over several nodes (llmgw.agent.rpc_relay carries their traffic);
a CUDA build's rpc-server serves the node's GPUs to a main node."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from llmgw.agent.engines import _toolchain

BINARY = "llama-server"
RPC_SERVER = "rpc-server"
# rpc-server's CMake target, whose binary the cache keeps as RPC_SERVER.
RPC_TARGET = "ggml-rpc-server"
MEMINFO = Path("/proc/meminfo")
# What one nvcc job of ggml-cuda's template instances may take at its peak (GiB): jobs
# beyond memory / this run a machine out of memory instead of building faster.
NVCC_JOB_GIB = 2.5
NICENESS = 19


def cmake_configure_args(tree: Path, build: Path, *, cuda_compiler: str | None = None,
                         rpc: bool = False) -> list[str]:
    """The CPU build's configure line (with the RPC backend where rpc); a CUDA build is
    cuda_configure_args'."""
    if cuda_compiler:
        raise ValueError("a CUDA build is configured by cuda_configure_args, for the "
                         "architectures NVML reports (never `native`)")
    args = [
        "cmake", "-S", str(tree), "-B", str(build),
        "-DCMAKE_BUILD_TYPE=Release",
        "-DLLAMA_CURL=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        # One self-contained file, so the cached binary can live anywhere.
        "-DBUILD_SHARED_LIBS=OFF",
        # Portable: a cache copied to another machine must not die of an illegal instruction.
        "-DGGML_NATIVE=OFF",
    ]
    if rpc:
        # The RPC backend: llama-server's --rpc, and the rpc-server target.
        args.append("-DGGML_RPC=ON")
    if shutil.which("ninja"):
        args += ["-G", "Ninja"]
    return args


def cuda_configure_args(tree: Path, build: Path, toolchain: _toolchain.Toolchain,
                        archs: list[str]) -> list[str]:
    """The CUDA build's configure line: the toolchain's nvcc and the architectures given,
    with the RPC backend (rpc-server, and llama-server's --rpc), as the CPU build's.

    Never `native`: it needs CMake 3.24 (Ubuntu 22.04 has 3.22) and a GPU at build time.
    Only these architectures, since building for every one takes hours. GGML_CUDA_NO_VMM,
    so nothing links libcuda (the wheels ship no stub; the driver's is loaded at run time).
    The RPATH is where the toolchain's libcudart and libcublas are, so the server finds them
    without LD_LIBRARY_PATH."""
    if not archs:
        raise ValueError("a CUDA build needs the GPUs' architectures")
    rpath = ";".join(str(d) for d in toolchain.rpath_dirs)
    args = [*cmake_configure_args(tree, build, rpc=True),
            "-DGGML_CUDA=ON",
            f"-DCMAKE_CUDA_COMPILER={toolchain.nvcc}",
            f"-DCUDAToolkit_ROOT={toolchain.root}",
            f"-DCMAKE_CUDA_ARCHITECTURES={';'.join(archs)}",
            "-DGGML_CUDA_NO_VMM=ON",
            f"-DCMAKE_BUILD_RPATH={rpath}",
            f"-DCMAKE_INSTALL_RPATH={rpath}"]
    if toolchain.include_dirs:
        # After nvcc's own headers: only what its toolkit lacks (cuBLAS, CCCL) comes from here.
        args.append("-DCMAKE_CUDA_STANDARD_INCLUDE_DIRECTORIES="
                    + ";".join(str(d) for d in toolchain.include_dirs))
    args += [f"-D{name}={path}" for name, path in toolchain.libraries]
    return args


def cmake_build_args(build: Path, jobs: int,
                     targets: tuple[str, ...] = (BINARY,)) -> list[str]:
    return ["cmake", "--build", str(build), "--target", *targets, "-j", str(jobs)]


def niced(cmd: list[str]) -> list[str]:
    """cmd at the lowest priority, so a long build leaves the node's serving its CPUs."""
    nice = shutil.which("nice")
    return [nice, "-n", str(NICENESS), *cmd] if nice else cmd


def mem_available_gib(meminfo: Path = MEMINFO) -> float | None:
    """MemAvailable from /proc/meminfo, in GiB; None when it cannot be read."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / (1024 * 1024)
    except (OSError, ValueError, IndexError):
        return None
    return None


def build_jobs(cores: int | None = None, available_gib: float | None = None,
               per_job_gib: float = NVCC_JOB_GIB) -> int:
    """Parallel jobs bounded by cores and by memory (per_job_gib each), at least one."""
    jobs = cores or os.cpu_count() or 1
    if available_gib is not None:
        jobs = min(jobs, int(available_gib / per_job_gib))
    return max(1, jobs)
