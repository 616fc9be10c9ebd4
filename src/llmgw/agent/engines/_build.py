"""Building llama-server, the one sequence for CPU and CUDA (`Driver`): the source fetched and
unpacked, configured and built with CMake (llmgw.agent.engines._cmake's command lines), progress
read from the build, the binary installed in the cache and the build logged beside it;
and what a CUDA build needs first (`CudaBuild`: the driver, the GPUs' architectures, the
toolchain)."""

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
from collections.abc import Callable, Iterable, Mapping
from dataclasses import KW_ONLY, dataclass
from pathlib import Path

from llmgw.agent.engines import _cmake, _toolchain, cache
from llmgw.agent.engines._cmake import MEMINFO, NICENESS
from llmgw.agent.gpus import Discovery
from llmgw.errors import Error
from llmgw.host import commands
from llmgw.host.commands import CommandFailed, run_logged

SOURCE_PACKAGE = "llama-cpp-python"
DOWNLOAD_TIMEOUT_S = 1800
_NINJA_STEP = re.compile(r"^\[(\d+)/(\d+)\]")
_MAKE_PERCENT = re.compile(r"^\[\s*(\d+)%\]")
_COMPILERS = ("c++", "g++", "clang++")
BINARY = cache.BINARY


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


def download_sdist(version: str, target: Path) -> Path:
    """The pinned source distribution, through pip and its configured package index, as
    target (the cache's llmgw.agent.engines.cache.sdist)."""
    sources = target.parent
    sources.mkdir(parents=True, exist_ok=True)
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
            tail = commands.tail((proc.stderr or proc.stdout).splitlines())
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


class Runner:
    """Runs build commands one at a time, logging them; stop() ends the running one."""

    def __init__(self, log: Path, search_path: str | None = None) -> None:
        self.log = log
        self.env = {**os.environ, "PATH": search_path} if search_path else None
        self._proc: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()
        self._stopped = False

    def run(self, cmd: list[str], on_line: Callable[[str], None] = lambda line: None) -> None:
        with self._lock:
            if self._stopped:
                raise BuildError("the agent is stopping; the build was not finished")
        shown = cmd[3:] if cmd[1:3] == ["-n", str(NICENESS)] else cmd
        try:
            run_logged(cmd, what=f"`{' '.join(shown[:3])} ...`", log=self.log, env=self.env,
                       on_line=on_line, started=self._started)
        except CommandFailed as e:
            raise BuildError(str(e)) from None

    def _started(self, proc: subprocess.Popen[str]) -> None:
        # A session of its own (run_logged's), so stop() ends the compilers too; one that
        # starts after stop() is ended at once.
        with self._lock:
            self._proc = proc
            stopped = self._stopped
        if stopped:
            self.stop()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            proc = self._proc
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


class Driver:
    """The one engine build, for CPU and CUDA alike, into target (a folder of the cache):
    one build of it at a time (a lock beside it), then the source fetched and unpacked,
    configured, built with its progress said, and installed as target/llama-server, every
    command logged to target/build.log. stop() ends a running build, or one yet to run."""

    def __init__(self, target: Path, *, on_progress: Callable[[str], None],
                 search_path: str | None = None, nice: bool = False,
                 what: str = "build", binaries: Mapping[str, str] | None = None) -> None:
        self.target = target
        # CMake target -> the file it is installed as in target.
        self.binaries = dict(binaries or {BINARY: BINARY})
        self.on_progress = on_progress
        self.search_path = search_path
        self.nice = nice
        self.what = what
        self.binary = target / BINARY
        self._runner: Runner | None = None
        self._stopped = False
        self._said = ""

    def run(self, source: Callable[[], Path], configure: Callable[[Path, Path], list[str]],
            jobs: Callable[[], int], *, configuring: str = "configuring",
            started: Callable[[int], str] = lambda jobs: "0%", header: str = "") -> bool:
        """Build unless the binary is there; whether this run built it (False: another
        build made it while this one waited). source is asked for only under the lock."""
        self.target.mkdir(parents=True, exist_ok=True)
        with open(cache.lock_file(self.target), "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._say("waiting for another build of this version to finish")
                fcntl.flock(lock, fcntl.LOCK_EX)
            if all((self.target / b).is_file() for b in self.binaries.values()):
                return False
            self._build(source, configure, jobs, configuring, started, header)
        return True

    def stop(self) -> None:
        self._stopped = True
        if self._runner is not None:
            self._runner.stop()

    def _build(self, source: Callable[[], Path], configure: Callable[[Path, Path], list[str]],
               jobs: Callable[[], int], configuring: str, started: Callable[[int], str],
               header: str) -> None:
        archive = source()
        work = Path(tempfile.mkdtemp(prefix=f"build-{self.target.name}-",
                                     dir=self.target.parent))
        log = self.target / "build.log"
        log.write_text(header)
        self._runner = runner = Runner(log, self.search_path)
        if self._stopped:
            runner.stop()
        try:
            self._say(f"unpacking {archive.name}")
            tree = unpack(archive, work / "src")
            build = work / "build"
            self._say(configuring)
            runner.run(self._cmd(configure(tree, build)))
            n = jobs()
            self._say(started(n))
            runner.run(self._cmd(_cmake.cmake_build_args(build, n, tuple(self.binaries))),
                       self._on_line)
            # llama-server last: its presence is what says the build is in the cache.
            for made, name in sorted(self.binaries.items(), key=lambda b: b[1] == BINARY):
                self._install(build / "bin" / made, name, log)
        finally:
            shutil.rmtree(work, ignore_errors=True)
            self._runner = None

    def _cmd(self, cmd: list[str]) -> list[str]:
        return _cmake.niced(cmd) if self.nice else cmd

    def _say(self, detail: str) -> None:
        self._said = detail
        self.on_progress(detail)

    def _on_line(self, line: str) -> None:
        percent = build_percent(line)
        if percent is not None and f"{percent}%" != self._said:
            self._say(f"{percent}%")

    def _install(self, built: Path, name: str, log: Path) -> None:
        if not built.is_file():
            raise BuildError(f"the {self.what} finished without {built}; see {log}")
        tmp = self.target / f".{name}.tmp"
        shutil.copy2(built, tmp)
        tmp.replace(self.target / name)


@dataclass(eq=False)
class CudaBuild:
    """llama-server with CUDA for this node's GPUs, into the cache; run() returns its path.

    The toolchain comes from _toolchain.find_toolchain (a system toolkit, completed or assembled
    in the cache); the build targets the compute capabilities NVML reports, at nice 19,
    with jobs bounded by cores and memory, through the one Driver; it is cached per
    version, CUDA major and architecture set (llmgw.agent.engines.cache.cuda_build), one build of
    each at a time. It has llama.cpp's RPC backend and installs rpc-server beside
    llama-server (in the `-rpc` folder); a build from before that, found in the cache, is
    used as it is (no rpc-server) until that folder is removed. Every failure is a
    BuildError with a one-line reason; stop() ends a running build. The source may be a
    way to get it (a download): it is asked for only once the driver, the tools and the
    toolchain allow a build, so a node that cannot build says why before any download."""

    version: str
    source: Path | Callable[[], Path]
    cache_dir: Path
    discovery: Discovery
    _: KW_ONLY
    on_progress: Callable[[str], None] = lambda line: None
    jobs: int | None = None
    search_path: str | None = None
    pip: _toolchain.Pip | None = None
    roots: Iterable[Path] = _toolchain.SYSTEM_ROOTS
    meminfo: Path = MEMINFO

    def __post_init__(self) -> None:
        self.roots = tuple(self.roots)
        self.archs = self.discovery.cuda_archs()
        self._driver: Driver | None = None
        self._stopped = False

    def cached(self) -> Path | None:
        """A build for these GPUs already in the cache (of the CUDA major they would get, or
        of CUDA 12 from a system toolkit): the one with the RPC backend, else one from
        before it; None when there is neither."""
        try:
            majors = dict.fromkeys([_toolchain.cuda_major(self.discovery), 12])
        except _toolchain.ToolchainError:
            return None
        for major in majors:
            for rpc in (True, False):
                binary = cache.cuda_build(self.cache_dir, self.version, self.archs, major,
                                          rpc=rpc) / BINARY
                if self.archs and binary.is_file() and os.access(binary, os.X_OK):
                    return binary
        return None

    def run(self) -> Path:
        found = self.cached()
        if found:
            return found
        self._preflight()
        try:
            toolchain = _toolchain.find_toolchain(self.cache_dir, self.discovery, pip=self.pip,
                                             search_path=self.search_path, roots=self.roots,
                                             on_progress=self.on_progress)
        except _toolchain.ToolchainError as e:
            raise BuildError(str(e)) from None
        self.on_progress(f"CUDA toolchain: {toolchain.origin}")
        target = cache.cuda_build(self.cache_dir, self.version, self.archs, toolchain.major,
                                  rpc=True)
        self._driver = driver = Driver(target, on_progress=self.on_progress,
                                       search_path=self.search_path, nice=True,
                                       what="CUDA build",
                                       binaries={BINARY: BINARY,
                                                 _cmake.RPC_TARGET: cache.RPC_SERVER})
        if self._stopped:
            driver.stop()
        try:
            driver.run(
                self._source,
                lambda tree, build: _cmake.cuda_configure_args(tree, build, toolchain,
                                                               self.archs),
                lambda: self.jobs or _cmake.build_jobs(os.cpu_count(),
                                                       _cmake.mem_available_gib(self.meminfo)),
                configuring=(f"configuring with CUDA {toolchain.version} for "
                             f"{', '.join('sm_' + a for a in self.archs)}"),
                started=lambda jobs: f"0% ({jobs} jobs)",
                header=f"# toolchain: {toolchain.origin}\n")
        finally:
            self._driver = None
        return driver.binary

    def _source(self) -> Path:
        return self.source() if callable(self.source) else self.source

    def stop(self) -> None:
        self._stopped = True
        if self._driver is not None:
            self._driver.stop()

    def _preflight(self) -> None:
        try:
            _toolchain.cuda_major(self.discovery)  # a driver too old for any toolkit: said first
        except _toolchain.ToolchainError as e:
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
