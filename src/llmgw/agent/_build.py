"""Building llama-server from a source archive with CMake, progress read from the build."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
from collections.abc import Callable
from pathlib import Path

from llmgw.errors import Error

SOURCE_PACKAGE = "llama-cpp-python"
DOWNLOAD_TIMEOUT_S = 1800
_NINJA_STEP = re.compile(r"^\[(\d+)/(\d+)\]")
_MAKE_PERCENT = re.compile(r"^\[\s*(\d+)%\]")
_COMPILERS = ("c++", "g++", "clang++")


class BuildError(Error):
    """The engine could not be fetched or built; the message says why and what to do."""


def build_percent(line: str) -> int | None:
    """The build's progress from one output line: ninja's `[N/M]` or make's `[ NN%]`."""
    m = _NINJA_STEP.match(line)
    if m and int(m.group(2)) > 0:
        return min(100, int(m.group(1)) * 100 // int(m.group(2)))
    m = _MAKE_PERCENT.match(line)
    return int(m.group(1)) if m else None


def missing_tools(search_path: str | None = None) -> list[str]:
    """What a build needs and this machine lacks: cmake, a C++ compiler."""
    missing = []
    if not shutil.which("cmake", path=search_path):
        missing.append("cmake")
    if not any(shutil.which(c, path=search_path) for c in _COMPILERS):
        missing.append("a C++ compiler (g++ or clang++)")
    return missing


def find_nvcc(search_path: str | None = None) -> str | None:
    found = shutil.which("nvcc", path=search_path)
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.exists() else None


def sdist_name(version: str) -> str:
    return f"llama_cpp_python-{version}.tar.gz"


def download_sdist(version: str, sources: Path) -> Path:
    """The pinned source distribution, through pip and its configured package index."""
    sources.mkdir(parents=True, exist_ok=True)
    target = sources / sdist_name(version)
    if target.exists():
        return target
    tmp = sources / f".download-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
        f"{SOURCE_PACKAGE}=={version}", "-d", str(tmp),
    ]
    try:
        proc = subprocess.run(
            cmd, check=False, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S
        )
        got = sorted(tmp.glob("*.tar.gz"))
        if proc.returncode != 0 or not got:
            tail = _tail((proc.stderr or proc.stdout).splitlines(), 3)
            raise BuildError(
                f"pip could not download the {SOURCE_PACKAGE} {version} source ({tail}); "
                "check the package index this machine uses, or set engine.source in "
                "agent.yaml to a local copy of the archive, then restart the agent"
            )
        got[0].replace(target)
    except subprocess.TimeoutExpired:
        raise BuildError(
            f"downloading the {SOURCE_PACKAGE} {version} source took over "
            f"{DOWNLOAD_TIMEOUT_S}s; set engine.source in agent.yaml to a local copy"
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def unpack(archive: Path, into: Path) -> Path:
    """Unpack a source archive (or take a folder) and find the llama.cpp tree in it."""
    if archive.is_dir():
        return find_tree(archive)
    shutil.rmtree(into, ignore_errors=True)
    into.mkdir(parents=True)
    try:
        with tarfile.open(archive) as tar:
            tar.extractall(into, filter="data")
    except (OSError, tarfile.TarError) as e:
        raise BuildError(
            f"cannot unpack {archive}: {e}; point engine.source at a .tar.gz of llama.cpp "
            f"or of {SOURCE_PACKAGE}"
        ) from e
    return find_tree(into)


def find_tree(root: Path) -> Path:
    """The llama.cpp source tree under root: CMakeLists.txt beside the server's C++ sources.

    The vendored tree is looked at first: llama-cpp-python's own root also has a
    CMakeLists.txt and an examples/server folder, of Python, which builds no llama-server.
    """
    for candidate in [*sorted(root.glob("*/vendor/llama.cpp")), root, *sorted(root.glob("*"))]:
        servers = [candidate / "tools" / "server", candidate / "examples" / "server"]
        if (candidate / "CMakeLists.txt").exists() and any(
            any(d.glob("*.cpp")) for d in servers if d.is_dir()
        ):
            return candidate
    raise BuildError(
        f"no llama.cpp source tree (CMakeLists.txt and tools/server) in {root}; "
        f"engine.source must be an archive of llama.cpp or of {SOURCE_PACKAGE}"
    )


def cmake_configure_args(tree: Path, build: Path, *, cuda_compiler: str | None) -> list[str]:
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
    if shutil.which("ninja"):
        args += ["-G", "Ninja"]
    if cuda_compiler:
        # Only the GPUs this machine has: building for every architecture takes hours.
        args += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_COMPILER={cuda_compiler}",
                 "-DCMAKE_CUDA_ARCHITECTURES=native"]
    return args


def cmake_build_args(build: Path, jobs: int) -> list[str]:
    return ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)]


class Runner:
    """Runs build commands one at a time, logging them; stop() ends the running one."""

    def __init__(self, log: Path, search_path: str | None = None) -> None:
        self.log = log
        self.env = {**os.environ, "PATH": search_path} if search_path else None
        self._proc: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()
        self._stopped = False

    def run(self, cmd: list[str], on_line: Callable[[str], None] = lambda line: None) -> None:
        with self.log.open("a") as log:
            log.write(f"$ {' '.join(cmd)}\n")
            log.flush()
            with self._lock:
                if self._stopped:
                    raise BuildError("the agent is stopping; the build was not finished")
                # A session of its own, so stop() ends the compilers too.
                self._proc = subprocess.Popen(
                    cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                    stdin=subprocess.DEVNULL, start_new_session=True, env=self.env,
                )
            lines: list[str] = []
            assert self._proc.stdout is not None
            for line in self._proc.stdout:
                log.write(line)
                lines.append(line.rstrip())
                del lines[:-20]
                on_line(line)
            rc = self._proc.wait()
        if rc != 0:
            raise BuildError(
                f"`{' '.join(cmd[:3])} ...` failed ({rc}): {_tail(lines, 3)}; the whole log is "
                f"{self.log}"
            )

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            proc = self._proc
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


def _tail(lines: list[str], n: int) -> str:
    kept = [line.strip() for line in lines if line.strip()][-n:]
    return " | ".join(kept) or "no output"
