"""Building llama-server from a source archive with CMake (on CPU, or with CUDA for the GPUs
NVML reports), progress read from the build."""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from llmgw.agent import _cuda
from llmgw.agent.gpus import Discovery
from llmgw.errors import Error

SOURCE_PACKAGE = "llama-cpp-python"
DOWNLOAD_TIMEOUT_S = 1800
_NINJA_STEP = re.compile(r"^\[(\d+)/(\d+)\]")
_MAKE_PERCENT = re.compile(r"^\[\s*(\d+)%\]")
_COMPILERS = ("c++", "g++", "clang++")
ENGINE_DIR = Path("engines") / "llamacpp"
BINARY = "llama-server"
MEMINFO = Path("/proc/meminfo")
# What one nvcc job of ggml-cuda's template instances may take at its peak (GiB): jobs
# beyond memory / this run a machine out of memory instead of building faster.
NVCC_JOB_GIB = 2.5
NICENESS = 19


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


def cmake_configure_args(tree: Path, build: Path, *,
                         cuda_compiler: str | None = None) -> list[str]:
    """The CPU build's configure line; a CUDA build is cuda_configure_args'."""
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
    if shutil.which("ninja"):
        args += ["-G", "Ninja"]
    return args


def cuda_configure_args(tree: Path, build: Path, toolchain: _cuda.Toolchain,
                        archs: list[str]) -> list[str]:
    """The CUDA build's configure line: the toolchain's nvcc and the architectures given.

    Never `native`: it needs CMake 3.24 (Ubuntu 22.04 has 3.22) and a GPU at build time.
    Only these architectures, since building for every one takes hours. GGML_CUDA_NO_VMM,
    so nothing links libcuda (the wheels ship no stub; the driver's is loaded at run time).
    The RPATH is where the toolchain's libcudart and libcublas are, so the server finds them
    without LD_LIBRARY_PATH."""
    if not archs:
        raise ValueError("a CUDA build needs the GPUs' architectures")
    rpath = ";".join(str(d) for d in toolchain.rpath_dirs)
    args = [*cmake_configure_args(tree, build),
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


def cmake_build_args(build: Path, jobs: int) -> list[str]:
    return ["cmake", "--build", str(build), "--target", BINARY, "-j", str(jobs)]


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


def arch_tag(archs: Iterable[str]) -> str:
    """The architectures as a cache name: ["90", "80"] is sm90_80."""
    return "sm" + "_".join(archs)


def cuda_engine_dir(cache_dir: Path, version: str, archs: list[str], major: int) -> Path:
    """Where the CUDA build of version for these architectures lives:
    <cache_dir>/engines/llamacpp/<version>-cuda<major>-sm90_80/."""
    return cache_dir / ENGINE_DIR / f"{version}-cuda{major}-{arch_tag(archs)}"


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
            shown = cmd[3:] if cmd[1:3] == ["-n", str(NICENESS)] else cmd
            raise BuildError(
                f"`{' '.join(shown[:3])} ...` failed ({rc}): {_tail(lines, 3)}; the whole log "
                f"is {self.log}"
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


class CudaBuild:
    """llama-server with CUDA for this node's GPUs, into the cache; run() returns its path.

    The toolchain comes from _cuda.find_toolchain (a system toolkit, completed or assembled
    in the cache); the build targets the compute capabilities NVML reports, at nice 19,
    with jobs bounded by cores and memory; it is cached per version, CUDA major and
    architecture set (cuda_engine_dir), one build of each at a time. Every failure is a
    BuildError with a one-line reason; stop() ends a running build. The source may be a
    way to get it (a download): it is asked for only once the driver, the tools and the
    toolchain allow a build, so a node that cannot build says why before any download."""

    def __init__(self, version: str, source: Path | Callable[[], Path], cache_dir: Path,
                 discovery: Discovery, *,
                 on_progress: Callable[[str], None] = lambda line: None,
                 jobs: int | None = None, search_path: str | None = None,
                 pip: _cuda.Pip | None = None, roots: Iterable[Path] = _cuda.SYSTEM_ROOTS,
                 meminfo: Path = MEMINFO) -> None:
        self.version = version
        self.source = source
        self.cache_dir = cache_dir
        self.discovery = discovery
        self.on_progress = on_progress
        self.jobs = jobs
        self.search_path = search_path
        self.pip = pip
        self.roots = tuple(roots)
        self.meminfo = meminfo
        self.archs = discovery.cuda_archs()
        self._runner: Runner | None = None
        self._stopped = False
        self._percent: int | None = None

    def cached(self) -> Path | None:
        """A build for these GPUs already in the cache (of the CUDA major they would get, or
        of CUDA 12 from a system toolkit), else None."""
        try:
            majors = dict.fromkeys([_cuda.cuda_major(self.discovery), 12])
        except _cuda.ToolchainError:
            return None
        for major in majors:
            binary = cuda_engine_dir(self.cache_dir, self.version, self.archs, major) / BINARY
            if self.archs and binary.is_file() and os.access(binary, os.X_OK):
                return binary
        return None

    def run(self) -> Path:
        found = self.cached()
        if found:
            return found
        self._preflight()
        try:
            toolchain = _cuda.find_toolchain(self.cache_dir, self.discovery, pip=self.pip,
                                             search_path=self.search_path, roots=self.roots,
                                             on_progress=self.on_progress)
        except _cuda.ToolchainError as e:
            raise BuildError(str(e)) from None
        self.on_progress(f"CUDA toolchain: {toolchain.origin}")
        target = cuda_engine_dir(self.cache_dir, self.version, self.archs, toolchain.major)
        target.mkdir(parents=True, exist_ok=True)
        with open(target.parent / f".{target.name}.lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self.on_progress("waiting for another build of this version to finish")
                fcntl.flock(lock, fcntl.LOCK_EX)
            if not (target / BINARY).is_file():  # else the other build made it
                self._build(toolchain, target)
        return target / BINARY

    def stop(self) -> None:
        self._stopped = True
        if self._runner is not None:
            self._runner.stop()

    def _preflight(self) -> None:
        try:
            _cuda.cuda_major(self.discovery)  # a driver too old for any toolkit: said first
        except _cuda.ToolchainError as e:
            raise BuildError(str(e)) from None
        if not self.archs:
            raise BuildError(
                "NVML reports no compute capability for this node's GPUs, so there is no "
                "architecture to build llama.cpp for; update nvidia-ml-py in llmgw's "
                "environment (or the driver) and restart the agent")
        missing = missing_tools(self.search_path)
        if missing:
            raise BuildError(
                f"building llama.cpp with CUDA needs {' and '.join(missing)}, which this "
                "machine lacks: install them (e.g. `apt-get install cmake g++`) and restart "
                "the agent, or set engine.cuda_server in agent.yaml to a llama-server built "
                "with CUDA")

    def _build(self, toolchain: _cuda.Toolchain, target: Path) -> None:
        work = Path(tempfile.mkdtemp(prefix=f"build-{target.name}-", dir=target.parent))
        log = target / "build.log"
        log.write_text(f"# toolchain: {toolchain.origin}\n")
        self._runner = runner = Runner(log, self.search_path)
        if self._stopped:
            runner.stop()
        try:
            source = self.source() if callable(self.source) else self.source
            tree = unpack(source, work / "src")
            build = work / "build"
            self.on_progress(f"configuring with CUDA {toolchain.version} for "
                             f"{', '.join('sm_' + a for a in self.archs)}")
            runner.run(niced(cuda_configure_args(tree, build, toolchain, self.archs)))
            jobs = self.jobs or build_jobs(os.cpu_count(), mem_available_gib(self.meminfo))
            self.on_progress(f"0% ({jobs} jobs)")
            runner.run(niced(cmake_build_args(build, jobs)), self._on_line)
            built = build / "bin" / BINARY
            if not built.is_file():
                raise BuildError(f"the CUDA build finished without {built}; see {log}")
            tmp = target / f".{BINARY}.tmp"
            shutil.copy2(built, tmp)
            tmp.replace(target / BINARY)
        finally:
            shutil.rmtree(work, ignore_errors=True)
            self._runner = None

    def _on_line(self, line: str) -> None:
        percent = build_percent(line)
        if percent is not None and percent != self._percent:
            self._percent = percent
            self.on_progress(f"{percent}%")


def build_cuda(version: str, source: Path, cache_dir: Path, discovery: Discovery, *,
               on_progress: Callable[[str], None] = lambda line: None,
               jobs: int | None = None, search_path: str | None = None) -> Path:
    """CudaBuild(...).run(): the CUDA llama-server for this node's GPUs, built or cached."""
    return CudaBuild(version, source, cache_dir, discovery, on_progress=on_progress,
                     jobs=jobs, search_path=search_path).run()

