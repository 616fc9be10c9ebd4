"""The build's command lines, CPU and CUDA: architectures from NVML (never `native`), nice
19, jobs bounded by memory, the toolchain's compiler, headers, libraries and RPATH, the
cache dir per architecture set; and a CUDA build run through with a stand-in cmake (no
real CUDA build here)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from llmgw.agent.engines import _build, _cmake, cache
from llmgw.agent.engines import _toolchain as _cuda
from llmgw.agent.engines._build import BuildError
from tests.agent.test_cuda import FakePip, node, system_root

TREE, BUILD = Path("/src/llama.cpp"), Path("/tmp/build")


def _toolchain(**kw: object) -> _cuda.Toolchain:
    fields: dict = {"nvcc": Path("/usr/local/cuda/bin/nvcc"), "major": 13, "version": "13.0",
                    "root": Path("/usr/local/cuda-13.0"), "origin": "system",
                    "library_dirs": (Path("/usr/local/cuda-13.0/lib64"),)}
    return _cuda.Toolchain(**{**fields, **kw})  # type: ignore[arg-type]


def _defines(args: list[str]) -> dict[str, str]:
    return dict(a[2:].split("=", 1) for a in args if a.startswith("-D"))


def test_cuda_configure_targets_the_architectures_given_never_native() -> None:
    args = _cmake.cuda_configure_args(TREE, BUILD, _toolchain(), ["90", "80"])
    d = _defines(args)
    assert d["CMAKE_CUDA_ARCHITECTURES"] == "90;80"
    assert not any("native" in a for a in args)
    assert d["GGML_CUDA"] == "ON" and d["GGML_NATIVE"] == "OFF"
    assert d["GGML_RPC"] == "ON", "rpc-server serves the node's GPUs to a main node"
    assert d["CMAKE_CUDA_COMPILER"] == "/usr/local/cuda/bin/nvcc"
    assert d["CUDAToolkit_ROOT"] == "/usr/local/cuda-13.0"
    assert d["GGML_CUDA_NO_VMM"] == "ON", "no libcuda link: the wheels ship no stub"
    assert d["CMAKE_BUILD_RPATH"] == d["CMAKE_INSTALL_RPATH"] == "/usr/local/cuda-13.0/lib64"
    assert "CMAKE_CUDA_STANDARD_INCLUDE_DIRECTORIES" not in d
    assert args[:5] == ["cmake", "-S", str(TREE), "-B", str(BUILD)]


def test_cuda_configure_takes_a_completed_toolkits_headers_libraries_and_rpath() -> None:
    extra = Path("/cache/cuda/13.0-cublas/nvidia/cu13")
    chain = _toolchain(include_dirs=(extra / "include",),
                       library_dirs=(Path("/usr/local/cuda-13.0/lib64"), extra / "lib"),
                       libraries=(("CUDA_cublas_LIBRARY", extra / "lib/libcublas.so"),
                                  ("CUDA_cublasLt_LIBRARY", extra / "lib/libcublasLt.so")))
    d = _defines(_cmake.cuda_configure_args(TREE, BUILD, chain, ["90"]))
    assert d["CMAKE_CUDA_STANDARD_INCLUDE_DIRECTORIES"] == f"{extra}/include"
    assert d["CUDA_cublas_LIBRARY"] == f"{extra}/lib/libcublas.so"
    assert d["CUDA_cublasLt_LIBRARY"] == f"{extra}/lib/libcublasLt.so"
    assert d["CMAKE_BUILD_RPATH"] == f"/usr/local/cuda-13.0/lib64;{extra}/lib"


def test_cuda_configure_without_architectures_is_refused() -> None:
    with pytest.raises(ValueError, match="architectures"):
        _cmake.cuda_configure_args(TREE, BUILD, _toolchain(), [])


def test_the_cpu_configure_line_has_no_cuda_and_refuses_a_compiler() -> None:
    """Negative control: `cuda_compiler` was where `native` came from."""
    args = _cmake.cmake_configure_args(TREE, BUILD)
    assert not any("CUDA" in a for a in args)
    with pytest.raises(ValueError, match="never `native`"):
        _cmake.cmake_configure_args(TREE, BUILD, cuda_compiler="/usr/bin/nvcc")


def test_the_cpu_build_has_the_rpc_backend_and_builds_rpc_server_too() -> None:
    """The node's CPU build is configured with GGML_RPC=ON and builds rpc-server's target
    beside llama-server's. The control: a configure line without rpc has no GGML_RPC."""
    assert "-DGGML_RPC=ON" in _cmake.cmake_configure_args(TREE, BUILD, rpc=True)
    assert not any("RPC" in a for a in _cmake.cmake_configure_args(TREE, BUILD))
    cmd = _cmake.cmake_build_args(BUILD, 2, ("llama-server", _cmake.RPC_TARGET))
    assert cmd[cmd.index("--target") + 1:cmd.index("-j")] == ["llama-server", "ggml-rpc-server"]


def test_a_build_runs_at_nice_19() -> None:
    cmd = _cmake.niced(_cmake.cmake_build_args(BUILD, 4))
    assert Path(cmd[0]).name == "nice" and cmd[1:3] == ["-n", "19"]
    assert cmd[3:] == ["cmake", "--build", str(BUILD), "--target", "llama-server", "-j", "4"]


@pytest.mark.parametrize("cores, gib, jobs", [
    (16, 128.0, 16),     # memory to spare: one job a core
    (16, 8.0, 3),        # 8 GiB holds three 2.5 GiB nvcc jobs, not sixteen
    (2, 64.0, 2),
    (16, 1.0, 1),        # never none
    (16, None, 16),      # MemAvailable unread: cores alone
])
def test_jobs_are_bounded_by_memory_as_well_as_cores(cores: int, gib: float | None,
                                                     jobs: int) -> None:
    assert _cmake.build_jobs(cores, gib) == jobs


def test_mem_available_is_read_from_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32768000 kB\nMemFree:         1000 kB\n"
                       "MemAvailable:    8388608 kB\n")
    assert _cmake.mem_available_gib(meminfo) == 8.0
    meminfo.write_text("MemTotal:       32768000 kB\n")
    assert _cmake.mem_available_gib(meminfo) is None
    assert _cmake.mem_available_gib(tmp_path / "absent") is None


@pytest.mark.parametrize("archs, major, name", [
    (["90", "80"], 13, "0.3.36-cuda13-sm90_80"),
    (["90"], 13, "0.3.36-cuda13-sm90"),
    (["120", "89"], 12, "0.3.36-cuda12-sm120_89"),
])
def test_the_cuda_engine_is_cached_per_version_major_and_architecture_set(
        archs: list[str], major: int, name: str) -> None:
    root = Path("/var/cache/llmgw")
    assert cache.cuda_build(root, "0.3.36", archs, major) == \
        root / "engines" / "llamacpp" / name


# --- a CUDA build run through, cmake stood in for ---

FAKE_CMAKE = """#!/bin/sh
echo "$@" >> "$FAKE_CMAKE_CALLS"
[ -n "$FAKE_CMAKE_FAIL" ] && { echo "CMake Error: $FAKE_CMAKE_FAIL"; exit 1; }
if [ "$1" = "--build" ]; then
  echo "[1/2] Building CUDA object ggml-cuda.cu.o"; echo "[2/2] Linking llama-server"
  mkdir -p "$2/bin"; printf '#!/bin/sh\\necho version: 1\\n' > "$2/bin/llama-server"
  chmod +x "$2/bin/llama-server"
  case "$*" in *ggml-rpc-server*) if [ -z "$FAKE_CMAKE_NO_RPC" ]; then
    printf '#!/bin/sh\\n' > "$2/bin/ggml-rpc-server"; chmod +x "$2/bin/ggml-rpc-server"; fi;;
  esac
fi
"""


@pytest.fixture
def stand_ins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """A dir with a stand-in cmake (records its calls) and c++, put first on the build's
    PATH, and a llama.cpp tree."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("cmake", FAKE_CMAKE), ("c++", "#!/bin/sh\nexit 0\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    tree = tmp_path / "llama.cpp"
    (tree / "tools" / "server").mkdir(parents=True)
    (tree / "CMakeLists.txt").write_text("project(llama.cpp)\n")
    (tree / "tools" / "server" / "server.cpp").write_text("int main() {}\n")
    calls = tmp_path / "cmake-calls"
    monkeypatch.setenv("FAKE_CMAKE_CALLS", str(calls))
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable:    8388608 kB\n")  # 8 GiB
    return {"bin": bin_dir, "tree": tree, "calls": calls, "meminfo": meminfo}


def _cuda_build(tmp_path: Path, stand_ins: dict[str, Path], lines: list[str],
                **kw: object) -> _build.CudaBuild:
    return _build.CudaBuild("0.3.36", stand_ins["tree"], tmp_path / "cache",
                            node("13.0", "9.0", "8.0"), on_progress=lines.append,
                            search_path=f"{stand_ins['bin']}:/usr/bin:/bin", pip=FakePip(),
                            roots=[system_root(tmp_path, "13.0")],
                            meminfo=stand_ins["meminfo"], **kw)  # type: ignore[arg-type]


def test_a_cuda_build_configures_builds_and_caches_for_its_architectures(
        tmp_path: Path, stand_ins: dict[str, Path]) -> None:
    lines: list[str] = []
    binary = _cuda_build(tmp_path, stand_ins, lines).run()
    target = tmp_path / "cache" / "engines" / "llamacpp" / "0.3.36-cuda13-sm90_80-rpc"
    assert binary == target / "llama-server" and os.access(binary, os.X_OK)
    assert os.access(target / "rpc-server", os.X_OK), "rpc-server installed beside it"
    configure, build = stand_ins["calls"].read_text().splitlines()
    assert "-DCMAKE_CUDA_ARCHITECTURES=90;80" in configure.split()
    assert "-DGGML_RPC=ON" in configure.split()
    assert f"-DCMAKE_CUDA_COMPILER={tmp_path / 'cuda-13.0' / 'bin' / 'nvcc'}" in configure
    assert "-DCUDA_cublas_LIBRARY=" in configure, "this machine's toolkit completed"
    jobs = min(os.cpu_count() or 1, 3)  # 8 GiB available: three 2.5 GiB nvcc jobs at most
    assert build.endswith(f"--target llama-server ggml-rpc-server -j {jobs}")
    assert f"0% ({jobs} jobs)" in lines
    log = (target / "build.log").read_text()
    assert log.count("nice -n 19 cmake") == 2
    assert lines[0].startswith("CUDA toolchain: the CUDA 13.0 toolkit at")
    assert "configuring with CUDA 13.0 for sm_90, sm_80" in lines
    assert lines[-2:] == ["50%", "100%"]
    assert not list(target.parent.glob("build-*")), "the work dir is gone"
    again: list[str] = []
    assert _cuda_build(tmp_path, stand_ins, again).run() == binary
    assert again == [] and len(stand_ins["calls"].read_text().splitlines()) == 2


def test_a_failing_cuda_build_is_one_line_naming_cmake_and_its_log(
        tmp_path: Path, stand_ins: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_CMAKE_FAIL", "CUDA::cublas not found")
    with pytest.raises(BuildError) as e:
        _cuda_build(tmp_path, stand_ins, []).run()
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("`cmake -S ")
    assert "CMake Error: CUDA::cublas not found" in message and "build.log" in message
    assert not (tmp_path / "cache" / "engines" / "llamacpp" / "0.3.36-cuda13-sm90_80-rpc" /
                "llama-server").exists()


def test_a_cuda_build_without_rpc_server_is_a_build_error_and_not_cached(
        tmp_path: Path, stand_ins: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A build whose rpc-server target made nothing fails naming the missing file, and
    leaves no llama-server in the cache (it would be taken for a whole build). The
    control is the test above: the same build making both is cached."""
    monkeypatch.setenv("FAKE_CMAKE_NO_RPC", "1")
    with pytest.raises(BuildError, match=r"the CUDA build finished without .*ggml-rpc-server"):
        _cuda_build(tmp_path, stand_ins, []).run()
    target = tmp_path / "cache" / "engines" / "llamacpp" / "0.3.36-cuda13-sm90_80-rpc"
    assert not (target / "llama-server").exists()


def _fake_binary(folder: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text("#!/bin/sh\necho version: 1\n")
    (folder / name).chmod(0o755)
    return folder / name


def test_an_earlier_cuda_build_serves_until_the_rpc_build_is_in_the_cache(
        tmp_path: Path, stand_ins: dict[str, Path]) -> None:
    """A CUDA build from before the RPC backend (<version>-cuda13-sm90_80/) is found and
    used as it is: nothing is built, and it has no rpc-server. Once the -rpc folder holds
    a build, that one is found. The control: with the earlier folder removed, run() builds
    into the -rpc folder (cmake runs)."""
    builds = tmp_path / "cache" / "engines" / "llamacpp"
    old = _fake_binary(builds / "0.3.36-cuda13-sm90_80", "llama-server")
    runner = _cuda_build(tmp_path, stand_ins, [])
    assert runner.cached() == old and runner.run() == old
    assert not stand_ins["calls"].exists(), "an earlier build serves: nothing built"
    assert not (old.parent / "rpc-server").exists()
    new = _fake_binary(builds / "0.3.36-cuda13-sm90_80-rpc", "llama-server")
    assert runner.cached() == new
    for made in (old, new):
        made.unlink()
    assert _cuda_build(tmp_path, stand_ins, []).run() == new
    assert len(stand_ins["calls"].read_text().splitlines()) == 2, "built: configure, build"
    assert (new.parent / "rpc-server").is_file()


def test_a_toolchain_that_cannot_be_had_is_a_build_error(
        tmp_path: Path, stand_ins: dict[str, Path]) -> None:
    with pytest.raises(BuildError, match=r"^this node needs CUDA 12 .*cuda-toolkit-12-4"):
        _build.CudaBuild("0.3.36", stand_ins["tree"], tmp_path / "cache", node("12.4"),
                         search_path=str(stand_ins["bin"]), pip=FakePip(), roots=[]).run()
    assert not stand_ins["calls"].exists(), "cmake never ran"


def test_gpus_without_a_known_capability_are_not_built_for(
        tmp_path: Path, stand_ins: dict[str, Path]) -> None:
    with pytest.raises(BuildError, match="no compute capability"):
        _build.CudaBuild("0.3.36", stand_ins["tree"], tmp_path / "cache", node("13.0", ""),
                         search_path=str(stand_ins["bin"]), pip=FakePip(), roots=[]).run()


# --- the one driver both builds run ---


def _driver(target: Path, stand_ins: dict[str, Path], said: list[str]) -> _build.Driver:
    return _build.Driver(target, on_progress=said.append,
                         search_path=f"{stand_ins['bin']}:/usr/bin:/bin")


def _cpu_configure(tree: Path, build: Path) -> list[str]:
    return _cmake.cmake_configure_args(tree, build)


def test_the_driver_builds_once_and_says_each_stage(
        tmp_path: Path, stand_ins: dict[str, Path]) -> None:
    """Unpacked, configured, built with its progress, installed, logged; run again with the
    binary there, it runs nothing (the cmake calls stay two)."""
    said: list[str] = []
    target = tmp_path / "cache" / "engines" / "llamacpp" / "0.3.36"
    driver = _driver(target, stand_ins, said)
    assert driver.run(lambda: stand_ins["tree"], _cpu_configure, lambda: 2)
    assert said == ["unpacking llama.cpp", "configuring", "0%", "50%", "100%"]
    assert os.access(target / "llama-server", os.X_OK)
    assert (target / "build.log").read_text().count("$ cmake") == 2
    assert not list(target.parent.glob("build-*")), "the work dir is gone"
    assert not _driver(target, stand_ins, said).run(lambda: stand_ins["tree"], _cpu_configure,
                                                    lambda: 2)
    assert len(stand_ins["calls"].read_text().splitlines()) == 2


def test_a_driver_stopped_before_it_runs_builds_nothing(
        tmp_path: Path, stand_ins: dict[str, Path]) -> None:
    """The agent going away while a build waits for its lock or its source: no command
    runs (negative control: the test above, not stopped, builds)."""
    target = tmp_path / "cache" / "engines" / "llamacpp" / "0.3.36"
    driver = _driver(target, stand_ins, [])
    driver.stop()
    with pytest.raises(BuildError, match="the agent is stopping"):
        driver.run(lambda: stand_ins["tree"], _cpu_configure, lambda: 2)
    assert not (target / "llama-server").exists() and not stand_ins["calls"].exists()


def test_the_build_sequence_is_written_once() -> None:
    """Only the driver runs build commands: the CPU engine and CudaBuild hand it their
    configure lines (no second sequence, no build_cuda)."""
    agent = Path(_build.__file__).parent
    runs = {p.name: p.read_text().count("Runner(") for p in sorted(agent.glob("*.py"))}
    assert {name: n for name, n in runs.items() if n} == {"_build.py": 1}
    assert not hasattr(_build, "build_cuda")
