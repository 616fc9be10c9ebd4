"""The CUDA toolchain: which CUDA a node needs, a system toolkit taken, completed or passed
over, one assembled from wheel layouts (file trees made here, as the real wheels lay them
out; nothing is downloaded), and the one-line reasons when none can be had."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from llmgw.agent.engines import _toolchain
from llmgw.agent.engines._toolchain import ToolchainError
from llmgw.agent.gpus import GPU, Discovery

# The files each cuda-toolkit extra brings, as the real wheels lay them out (read from
# `unzip -l` of nvidia-cuda-runtime 13.5.37 / -cu12 12.9.79, nvidia-cuda-nvcc-cu12 12.9.86,
# nvidia-cuda-cccl-cu12 12.9.27, nvidia-cuda-crt 13.5.37, and the RECORDs of the CUDA 13.0
# wheels this machine's /usr/local/cuda was assembled from). "nvcc" is the compiler's stand-in.
CU13 = {
    "nvcc": ["bin/nvcc", "bin/nvcc.profile", "bin/ptxas", "bin/fatbinary", "bin/nvlink",
             "bin/cudafe++", "bin/bin2c", "bin/crt/link.stub", "include/fatbinary_section.h",
             "include/crt/host_config.h", "nvvm/bin/cicc", "nvvm/libdevice/libdevice.10.bc",
             "lib/libnvvm.so.4", "include/cuda_runtime.h", "lib/libcudart.so.13"],
    "cudart": ["include/cuda_runtime.h", "include/cuda_runtime_api.h",
               "include/cooperative_groups.h", "lib/libcudart.so.13", "lib/libcudart_static.a",
               "lib/libcudadevrt.a"],
    "cublas": ["include/cublas_v2.h", "include/cublas_api.h", "include/cublasLt.h",
               "lib/libcublas.so.13", "lib/libcublasLt.so.13", "lib/libnvrtc.so.13"],
    "cccl": ["include/cccl/cub/cub.cuh", "include/cccl/thrust/version.h",
             "include/cccl/cuda/std/version"],
}
CU12 = {
    # nvidia-cuda-nvcc-cu12 has ptxas and libnvvm, but no nvcc.
    "nvcc": ["cuda_nvcc/bin/ptxas", "cuda_nvcc/nvvm/lib64/libnvvm.so",
             "cuda_nvcc/include/crt/host_config.h"],
    "cudart": ["cuda_runtime/include/cuda_runtime.h", "cuda_runtime/lib/libcudart.so.12",
               "cuda_runtime/lib/libcudart_static.a"],
    "cublas": ["cublas/include/cublas_v2.h", "cublas/include/cublasLt.h",
               "cublas/lib/libcublas.so.12", "cublas/lib/libcublasLt.so.12",
               "cublas/lib/libnvblas.so.12"],
    "cccl": ["cuda_cccl/include/cub/cub.cuh", "cuda_cccl/include/thrust/version.h"],
}
_REQUIREMENT = re.compile(r"^cuda-toolkit\[([\w,]+)\]>=(\d+)\.(\d+),<(\d+)\.(\d+)$")


def fake_nvcc(path: Path, release: str) -> Path:
    """An executable answering --version as nvcc does."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
                    f"echo 'Cuda compilation tools, release {release}, V{release}.88'\n")
    path.chmod(0o755)
    return path


class FakePip:
    """pip install --target of cuda-toolkit[extras] as file trees: CUDA 13's under
    nvidia/cu13/, CUDA 12's each in nvidia/<pkg>/; the newest minor the pin allows."""

    def __init__(self, newest_minor: int = 5, drop: tuple[str, ...] = ()) -> None:
        self.calls: list[list[str]] = []
        self.newest_minor = newest_minor
        self.drop = drop

    def __call__(self, requirements: list[str], target: Path) -> None:
        self.calls.append(requirements)
        for requirement in requirements:
            m = _REQUIREMENT.match(requirement)
            assert m, requirement
            major, minor = int(m.group(2)), min(self.newest_minor, int(m.group(5)) - 1)
            for extra in m.group(1).split(","):
                for name in (CU13 if major == 13 else CU12)[extra]:
                    self._write(target, major, name, f"{major}.{minor}")

    def _write(self, target: Path, major: int, name: str, release: str) -> None:
        if any(name.endswith(d) for d in self.drop):
            return
        path = target / "nvidia" / ("cu13/" + name if major == 13 else name)
        if name == "bin/nvcc":
            fake_nvcc(path, release)
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(name)


def system_root(tmp_path: Path, release: str = "13.0", cublas: bool = False,
                runtime: bool = True) -> Path:
    """A toolkit like this machine's /usr/local/cuda: CUDA 13 wheels' nvcc, runtime and
    CCCL, linked into one tree, and no cuBLAS."""
    root = tmp_path / f"cuda-{release}"
    if root.exists():  # made before in this test
        return root
    fake_nvcc(root / "bin" / "nvcc", release)
    major = release.split(".")[0]
    files = ["include/cccl/cub/cub.cuh"]
    if runtime:
        files += ["include/cuda_runtime.h", f"lib/libcudart.so.{major}"]
    if cublas:
        files += ["include/cublas_v2.h", f"lib/libcublas.so.{major}", f"lib/libcublasLt.so.{major}"]
    for name in files:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(name)
    for lib in (root / "lib").glob("*.so.*"):
        (lib.parent / lib.name.rsplit(".so.", 1)[0]).with_suffix(".so").symlink_to(lib.name)
    (root / "lib64").symlink_to("lib")
    return root


def node(cuda_driver: str = "13.0", *capabilities: str) -> Discovery:
    caps = capabilities or ("9.0",)
    return Discovery([GPU(i, "NVIDIA H100 80GB HBM3", 81559, f"GPU-{i}", "h100-80gb",
                          compute_capability=cc) for i, cc in enumerate(caps)],
                     cuda_driver=cuda_driver, driver_version="580.65.06")


def find(tmp_path: Path, discovery: Discovery, pip: FakePip, *roots: Path) -> _toolchain.Toolchain:
    # search_path="" keeps this machine's own nvcc out of it; roots stand for /usr/local/cuda.
    return _toolchain.find_toolchain(tmp_path / "cache", discovery, pip=pip, search_path="",
                                roots=roots)


@pytest.mark.parametrize("driver, caps, major", [
    ("13.0", ("9.0", "8.0"), 13),
    ("13.2", ("7.5",), 13),
    ("12.4", ("9.0",), 12),          # the driver runs CUDA 12 only
    ("13.0", ("9.0", "7.0"), 12),    # a V100: CUDA 13 no longer builds for it
    ("13.0", ("9.0", ""), 12),       # a GPU's capability unknown: the safe choice
    ("", ("9.0",), 12),              # the driver's CUDA unknown
])
def test_cuda_13_only_where_the_driver_runs_it_and_every_gpu_is_7_5_or_more(
        driver: str, caps: tuple[str, ...], major: int) -> None:
    assert _toolchain.cuda_major(node(driver, *caps)) == major


def test_a_driver_older_than_cuda_12_is_told_to_update() -> None:
    with pytest.raises(ToolchainError, match=r"runs CUDA 11\.8.*update the driver"):
        _toolchain.cuda_major(node("11.8"))


def test_a_complete_system_toolkit_is_taken_as_it_is(tmp_path: Path) -> None:
    root = system_root(tmp_path, cublas=True)
    pip = FakePip()
    chain = find(tmp_path, node("13.0"), pip, root)
    assert pip.calls == []
    assert (chain.nvcc, chain.major, chain.version) == (root / "bin" / "nvcc", 13, "13.0")
    assert chain.include_dirs == () and chain.libraries == ()
    assert chain.rpath_dirs == (root / "lib64",)
    assert chain.origin.startswith(f"system (the CUDA 13.0 toolkit at {root.resolve()}")


def test_a_system_toolkit_without_cublas_is_completed_from_wheels_of_its_release(
        tmp_path: Path) -> None:
    """This machine's case: nvcc 13.0 from wheels, no cuBLAS; the driver runs 13.2."""
    root = system_root(tmp_path, "13.0")
    pip = FakePip()
    chain = find(tmp_path, node("13.2"), pip, root)
    extra = tmp_path / "cache" / "cuda" / "13.0-cublas" / "nvidia" / "cu13"
    assert pip.calls == [["cuda-toolkit[cublas]>=13.0,<13.1"]]
    assert chain.nvcc == root / "bin" / "nvcc" and chain.major == 13
    assert chain.include_dirs == (extra / "include",)
    assert dict(chain.libraries) == {"CUDA_cublas_LIBRARY": extra / "lib" / "libcublas.so",
                                     "CUDA_cublasLt_LIBRARY": extra / "lib" / "libcublasLt.so"}
    for _, lib in chain.libraries:
        assert lib.is_symlink() and lib.resolve().name.endswith(".so.13")
    assert chain.rpath_dirs == (root / "lib64", extra / "lib")
    assert "with cuBLAS from" in chain.origin
    find(tmp_path, node("13.2"), pip, root)
    assert len(pip.calls) == 1, "installed once, then taken from the cache"


def test_a_system_cuda_12_without_cublas_is_completed_from_the_cu12_wheels(
        tmp_path: Path) -> None:
    root = system_root(tmp_path, "12.4")
    pip = FakePip()
    chain = find(tmp_path, node("12.4"), pip, root)
    extra = tmp_path / "cache" / "cuda" / "12.4-cublas" / "nvidia" / "cublas"
    assert pip.calls == [["cuda-toolkit[cublas]>=12.4,<12.5"]]
    assert chain.major == 12 and chain.include_dirs == (extra / "include",)
    assert dict(chain.libraries)["CUDA_cublas_LIBRARY"].resolve().name == "libcublas.so.12"


def test_without_a_toolkit_cuda_13_is_assembled_no_newer_than_the_driver(
        tmp_path: Path) -> None:
    pip = FakePip(newest_minor=5)
    chain = find(tmp_path, node("13.2"), pip)
    root = tmp_path / "cache" / "cuda" / "13" / "nvidia" / "cu13"
    assert pip.calls == [["cuda-toolkit[nvcc,cudart,cublas,cccl]>=13.0,<13.3"]]
    assert (chain.nvcc, chain.major, chain.version) == (root / "bin" / "nvcc", 13, "13.2")
    assert chain.rpath_dirs == (root / "lib64",)
    for link, versioned in (("libcudart.so", "libcudart.so.13"),
                            ("libcublas.so", "libcublas.so.13"),
                            ("libcublasLt.so", "libcublasLt.so.13")):
        assert (root / "lib" / link).resolve() == (root / "lib" / versioned).resolve()
    # nvcc.profile's -I$(TOP)/targets/<platform>/include must find the headers.
    assert (root / "targets" / _toolchain._target_dir() / "include" / "cuda_runtime.h").is_file()
    assert (root / "lib64" / "libcudart.so").exists()
    assert (tmp_path / "cache" / "cuda" / "13" / ".llmgw-installed").is_file()


def test_a_system_toolkit_without_its_runtime_is_passed_over_for_an_assembled_one(
        tmp_path: Path) -> None:
    """Negative control of the completion: only cuBLAS and CCCL are added to a system's
    nvcc; one without cuda_runtime.h and libcudart gives way to a whole toolkit."""
    root = system_root(tmp_path, "13.0", runtime=False)
    lines: list[str] = []
    chain = _toolchain.find_toolchain(tmp_path / "cache", node("13.0"), pip=FakePip(),
                                 search_path="", roots=[root], on_progress=lines.append)
    assert chain.origin.startswith("cache (")
    assert lines == [f"CUDA toolchain: assembling CUDA 13 from the package index into "
                     f"{tmp_path / 'cache' / 'cuda' / '13'} (the CUDA 13.0 toolkit at "
                     f"{root.resolve()} lacks runtime and cuBLAS)"]


def test_cuda_12_without_a_toolkit_says_what_to_install_in_one_line(tmp_path: Path) -> None:
    pip = FakePip()
    with pytest.raises(ToolchainError) as e:
        find(tmp_path, node("12.4"), pip)
    message = str(e.value)
    assert "\n" not in message and pip.calls == []
    assert message.startswith("this node needs CUDA 12 (the driver runs CUDA 12.4, not 13); "
                              "there is no CUDA toolkit here")
    assert "nvidia-cuda-nvcc-cu12 ships ptxas, no nvcc" in message
    assert "apt-get install cuda-toolkit-12-4" in message and "restart the agent" in message


def test_a_cuda_13_toolkit_on_a_cuda_12_driver_is_named_as_passed_over(tmp_path: Path) -> None:
    root = system_root(tmp_path, "13.0", cublas=True)
    with pytest.raises(ToolchainError, match=r"toolkit at .* is newer than the driver's CUDA "
                                             r"12\.4, and the package index"):
        find(tmp_path, node("12.4"), FakePip(), root)


def test_a_cuda_13_toolkit_with_a_v100_is_passed_over(tmp_path: Path) -> None:
    root = system_root(tmp_path, "13.0", cublas=True)
    with pytest.raises(ToolchainError, match=r"is CUDA 13, and GPU 1 \(NVIDIA H100 80GB HBM3\) "
                                             r"has compute capability 7\.0"):
        find(tmp_path, node("13.0", "9.0", "7.0"), FakePip(), root)


def test_wheels_that_do_not_bring_what_they_should_are_named_and_not_kept(
        tmp_path: Path) -> None:
    """An index whose cuBLAS wheel lacks its library: said, and the next start tries again."""
    pip = FakePip(drop=("libcublas.so.13",))
    with pytest.raises(ToolchainError, match=r"^cuda-toolkit\[nvcc,cudart,cublas,cccl\]>=13.0,"
                                             r"<13.1 from the package index brought no cuBLAS"):
        find(tmp_path, node("13.0"), pip)
    assert not (tmp_path / "cache" / "cuda" / "13").exists()
    with pytest.raises(ToolchainError, match=r"lacks cuBLAS, and cuda-toolkit\[cublas\]>=13.0,"
                                             r"<13.1 from the package index did not bring cuBLAS"):
        find(tmp_path, node("13.0"), pip, system_root(tmp_path, "13.0"))
    assert not (tmp_path / "cache" / "cuda" / "13.0-cublas").exists()
    find(tmp_path, node("13.0"), FakePip())  # the index mended: the same call assembles it


def test_this_machines_toolkit_is_seen_as_cuda_13_without_cublas() -> None:
    """/usr/local/cuda here was assembled from CUDA 13 wheels: nvcc, runtime, CCCL, no cuBLAS."""
    if not Path("/usr/local/cuda/bin/nvcc").is_file():
        pytest.skip("no /usr/local/cuda here")
    found = _toolchain.system_toolkit(search_path="")
    assert found is not None and found.version is not None and found.version[0] >= 12
    if "cuBLAS" not in found.parts.missing():
        pytest.skip("this machine's toolkit has cuBLAS")
    assert found.parts.missing() == ["cuBLAS"]


def test_pip_failing_leaves_no_half_installed_toolkit(tmp_path: Path) -> None:
    def failing(requirements: list[str], target: Path) -> None:
        (target / "nvidia" / "cu13" / "bin").mkdir(parents=True)
        raise ToolchainError("pip could not install cuda-toolkit (1: no index)")

    with pytest.raises(ToolchainError, match="pip could not install"):
        _toolchain.find_toolchain(tmp_path / "cache", node("13.0"), pip=failing, search_path="",
                             roots=[])
    assert list((tmp_path / "cache" / "cuda").iterdir()) == [
        tmp_path / "cache" / "cuda" / ".13.lock"]
