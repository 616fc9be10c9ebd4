"""scripts/gpu-check on machines without a GPU: it says so in one line and exits 3; with a
stand-in NVML it gets past that check (and stops, clearly, before any CUDA build); its
standard-library GGUF writer makes a model the CPU llama-server serves, whose loader lines
it reads at --log-verbosity 4; --prepare trims the pinned llama.cpp tree to what the
agent's CUDA configure line needs, long names and app/ included, and that line configures
it for sm_90 on the toolkit the agent assembles from wheels. bench/gpu_fleet.py's logic
is held here too. The real run is on a lent GPU (bench/README.md, 'GPU check')."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu-check"
STANDIN = ROOT / "tests" / "standin_nvml"


def gpu_check() -> ModuleType:
    """scripts/gpu-check as a module."""
    loader = importlib.machinery.SourceFileLoader("gpu_check", str(SCRIPT))
    spec = importlib.util.spec_from_loader("gpu_check", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def run(*args: str, env: dict[str, str] | None = None,
        timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("mode", [[], ["--fleet"]], ids=["build-and-serve", "fleet"])
def test_without_a_gpu_it_says_so_in_one_line_and_exits_3(tmp_path: Path,
                                                           mode: list[str]) -> None:
    done = run(*mode, "--out", str(tmp_path / "out"),
               env={"LLMGW_GPU_CHECK_DIR": str(tmp_path)})
    assert done.returncode == 3, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: no NVIDIA GPU here: "), lines
    assert "needs a GPU machine" in lines[0] and done.stdout == ""


@pytest.mark.parametrize("mode", ["--build", "--fleet"])
def test_negative_control_with_a_standin_nvml_it_passes_the_gpu_check(tmp_path: Path,
                                                                      mode: str) -> None:
    """The same command where NVML reports an H100: NVML's view is written, and it stops
    for want of the prepared tree (no CUDA build, no host is started here)."""
    out = tmp_path / "out"
    done = run(mode, "--out", str(out), env={
        "LLMGW_GPU_CHECK_DIR": str(tmp_path), "PYTHONPATH": str(STANDIN)})
    assert done.returncode == 1 and "--prepare" in done.stderr, done
    view = json.loads((out / "nvml.json").read_text())
    assert [g["name"] for g in view["gpus"]] == ["NVIDIA H100 80GB HBM3"]
    assert view["gpus"][0]["compute_capability"] == "9.0"


def test_its_gguf_is_served_by_the_cpu_engine_with_device_none(tmp_path: Path,
                                                                llama_server: str) -> None:
    """The standard-library writer's model (small here) loads and answers 256 tokens."""
    done = run("--cpu-only", "--small", "--engine", llama_server, "--out", str(tmp_path),
               env={"LLMGW_GPU_CHECK_DIR": str(tmp_path), "TMPDIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    line = json.loads(done.stdout.strip().splitlines()[-1])
    assert line["cpu_tokens_per_s"] > 0
    served = json.loads((tmp_path / "serve.json").read_text())["cpu"]
    assert served["predicted"] == 256
    # The loader's lines are there (--log-verbosity 4): each buffer's size; a build with
    # no GPU backend offloads nothing: no offload line, or (one with the RPC backend, whose
    # devices llama.cpp counts as offload targets) 0 of the model's layers.
    assert served["buffers_mib"]["model"] and served["buffers_mib"]["kv"], served
    offloaded = served["layers_offloaded"]
    assert offloaded is None or offloaded.startswith("0/"), served


def test_offload_is_read_from_llama_cpps_own_loader_lines() -> None:
    gc = gpu_check()
    log = ("load_tensors: offloading output layer to GPU\n"
           "load_tensors: offloaded 17/17 layers to GPU\n"
           "load_tensors:        CUDA0 model buffer size =   512.50 MiB\n"
           "load_tensors:   CPU_Mapped model buffer size =    62.50 MiB\n"
           "llama_kv_cache:      CUDA0 KV buffer size =  4096.00 MiB\n"
           "sched_reserve:      CUDA0 compute buffer size =   300.75 MiB\n")
    assert gc.offload(log) == {"layers_offloaded": "17/17", "buffers_mib": {
        "model": {"CUDA0": 512.5, "CPU_Mapped": 62.5}, "kv": {"CUDA0": 4096.0},
        "compute": {"CUDA0": 300.75}}}
    # Negative control: the default verbosity's log has none of them, and none is made up.
    assert gc.offload("main: server is listening on http://127.0.0.1:8080\n") == {
        "layers_offloaded": None, "buffers_mib": {}}


def _long_named_tar(path: Path, name: str) -> None:
    with tarfile.open(path, "w:gz", format=tarfile.PAX_FORMAT) as t:
        info = tarfile.TarInfo(name)
        info.size = 2
        t.addfile(info, io.BytesIO(b"ok"))


def test_a_long_name_is_repacked_under_its_new_name(tmp_path: Path) -> None:
    """A member whose name needed a pax `path` record unpacks under the name it was
    packed as, not under the sdist's prefix the record still held."""
    long = "llama_cpp_python-0.3.36/vendor/llama.cpp/" + "d/" * 40 + "instance.cu"
    _long_named_tar(tmp_path / "src.tar.gz", long)
    gc = gpu_check()

    def repack(rename) -> str:  # type: ignore[no-untyped-def]
        with tarfile.open(tmp_path / "src.tar.gz") as src, \
                tarfile.open(tmp_path / "out.tar.gz", "w:gz") as out:
            (member,) = src.getmembers()
            assert member.name == long and member.pax_headers["path"] == long
            new = "llama.cpp/" + member.name.split("llama.cpp/", 1)[1]
            out.addfile(rename(member, new), src.extractfile(member))
        with tarfile.open(tmp_path / "out.tar.gz") as t:
            return t.getnames()[0]

    assert repack(gc.renamed).startswith("llama.cpp/d/d/")
    # Negative control: renamed in place with its pax headers kept (the shipped bug), it
    # unpacks under the old prefix again.
    assert repack(lambda m, n: m.replace(name=n, deep=False)) == long


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory, llama_server: str) -> Path:
    """The pinned sdist's tree as --prepare packs it: the llama_server fixture's build
    caches the sdist (skipped where a llama-server was found without one)."""
    gc = gpu_check()
    if not gc.SDIST.is_file():
        pytest.skip(f"no cached sdist at {gc.SDIST} (the llama_server fixture's build or a "
                    "provision with --engine-prebuilt off puts it there)")
    archive = tmp_path_factory.mktemp("gpu-check") / "llama.cpp.tar.gz"
    gc.pack_tree(gc.SDIST, archive)
    return archive


def test_prepare_packs_every_cuda_template_instance_and_app(packed: Path) -> None:
    """Every file the CUDA server build's CMake lists glob or add is in the packed tree:
    all of ggml-cuda's template instances of the sdist, app/ (the root CMakeLists adds
    it), the server; the models' vocabularies and docs stay out, and it fits the device's
    64 MiB with room."""
    gc = gpu_check()
    prefix = f"llama_cpp_python-{gc.PINNED}/vendor/llama.cpp/"
    with tarfile.open(gc.SDIST) as src:
        instances = {"llama.cpp/" + n[len(prefix):] for n in src.getnames()
                     if n.startswith(prefix + "ggml/src/ggml-cuda/template-instances/")
                     and n.endswith(".cu")}
    with tarfile.open(packed) as t:
        names = set(t.getnames())
    assert len(instances) >= 100 and instances <= names, sorted(instances - names)[:5]
    assert {"llama.cpp/CMakeLists.txt", "llama.cpp/app/CMakeLists.txt",
            "llama.cpp/tools/server/server.cpp"} <= names
    assert not any(n.startswith(("llama.cpp/models/", "llama.cpp/docs/")) for n in names)
    assert packed.stat().st_size < 16 << 20
    assert gc.missing(packed) == []


def test_negative_control_a_tree_short_of_one_instance_is_named(packed: Path,
                                                                 tmp_path: Path) -> None:
    gc = gpu_check()
    short = tmp_path / "short.tar"
    gone = "llama.cpp/ggml/src/ggml-cuda/template-instances/fattn-vec-instance-f16-f16.cu"
    with tarfile.open(packed) as src, tarfile.open(short, "w") as out:
        for member in src.getmembers():
            if member.name != gone:
                out.addfile(member, src.extractfile(member) if member.isfile() else None)
    assert gc.missing(short) == [gone]


def _cached_toolkit() -> Path:
    gc = gpu_check()
    nvcc = gc.CACHE / "cuda" / "13" / "nvidia" / "cu13" / "bin" / "nvcc"
    if not (gc.CACHE / "cuda" / "13" / ".llmgw-installed").is_file() or not nvcc.is_file():
        pytest.skip("no CUDA 13 toolkit assembled in the cache (`scripts/gpu-check "
                    "--rehearse` assembles it from the package index, about 1 GiB)")
    return nvcc


@pytest.mark.slow
def test_the_agents_cuda_configure_line_passes_on_the_packed_tree(packed: Path,
                                                                  tmp_path: Path) -> None:
    """The agent's own configure line, for sm_90, with the CUDA 13 toolchain it assembles
    from wheels, configures the packed tree (no build); then, as a negative control, the
    same tree short of one template instance stops at configure, naming it."""
    _cached_toolkit()
    from llmgw.agent.engines import _build, _cmake, _toolchain
    from llmgw.agent.gpus import GPU, Discovery

    gc = gpu_check()
    h200 = Discovery([GPU(0, "NVIDIA H200", 143771, "GPU-x", "h200", 143000, "9.0")],
                     cuda_driver="13.0")
    toolchain = _toolchain.find_toolchain(gc.CACHE, h200, roots=(), search_path="/usr/bin:/bin")
    tree = _build.unpack(packed, tmp_path / "src")

    def configure(build: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(_cmake.cuda_configure_args(tree, tmp_path / build, toolchain,
                                                         ["90"]),
                              capture_output=True, text=True, timeout=600)

    done = configure("build")
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "Including CUDA backend" in done.stdout
    gone = tree / "ggml" / "src" / "ggml-cuda" / "template-instances"
    (gone / "fattn-vec-instance-f16-f16.cu").unlink()
    broken = configure("broken")
    assert broken.returncode != 0
    assert "fattn-vec-instance-f16-f16.cu" in broken.stdout + broken.stderr


# --- bench/gpu_fleet.py's logic ---

def fleet() -> ModuleType:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_fleet
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return gpu_fleet


def test_the_fleet_waits_for_the_gpu_replica_alone() -> None:
    f = fleet()
    assert f.on_gpu([{"profile": "gpu-h200", "state": "ready"}])
    assert not f.on_gpu([{"profile": "gpu-h200", "state": "ready"},
                         {"profile": "cpu", "state": "ready"}])
    assert not f.on_gpu([{"profile": "gpu-h200", "state": "starting"}])
    assert not f.on_gpu([])


def test_default_slots_are_the_replicas_line_less_parallel() -> None:
    f = fleet()
    argv = ["llama-server", "-m", "m.gguf", "--parallel", "24", "--ctx-size", "98304",
            "--port", "4000", "--n-gpu-layers", "999"]
    assert f.without(argv, "--parallel", "-np", "--port") == [
        "llama-server", "-m", "m.gguf", "--ctx-size", "98304", "--n-gpu-layers", "999"]
    assert f.flag(argv, "--parallel", "-np") == "24" and f.flag(argv, "-np") is None


def test_the_fleets_line_holds_each_goal_to_its_figure(tmp_path: Path) -> None:
    f = fleet()
    report = f.Report(tmp_path)
    report.data.update(
        move={"failed": 0, "moved": True, "under_load": True, "requests": 200},
        gateway_vs_direct_1={"ratio": 0.97}, gateway_vs_direct_32={"ratio": 0.96},
        sized_vs_default={"ratio": 3.2}, sized={"total_slots": 32},
        default={"total_slots": 4})
    assert f.finish(report, 0) == 0
    line = json.loads((tmp_path / "gpu-check.json").read_text())
    assert line["goals"] == {"no_failed_request": True, "gateway_ge_0.95": True,
                             "sized_ge_3x": True}
    assert (line["sized_slots"], line["default_slots"]) == (32, 4)
    # Negative control: one failed request, a ratio just under, slots just short.
    report.data.update(move={"failed": 1, "moved": True, "under_load": True, "requests": 200},
                       gateway_vs_direct_32={"ratio": 0.949},
                       sized_vs_default={"ratio": 2.99})
    f.finish(report, 0)
    line = json.loads((tmp_path / "gpu-check.json").read_text())
    assert line["goals"] == {"no_failed_request": False, "gateway_ge_0.95": False,
                             "sized_ge_3x": False}


def test_the_split_step_holds_the_engine_to_the_replicas_two_cards() -> None:
    """What the split step found passes only with the engine on the replica's two cards
    (CUDA_VISIBLE_DEVICES in their order), --split-mode layer, --tensor-split 1,1 and, on
    a GPU, memory held on each of them by NVML's count. Each broken in turn fails it."""
    f = fleet()
    found = {"gpus": ["GPU-a", "GPU-b"], "cuda_visible_devices": "GPU-a,GPU-b",
             "split_mode": "layer", "tensor_split": "1,1",
             "held_mib_by_card": {"GPU-a": 900, "GPU-b": 880}}
    assert f.split_ok(found, dry_run=False)
    for key, broken in (("cuda_visible_devices", "GPU-a"), ("split_mode", None),
                        ("tensor_split", "3,1"), ("gpus", ["GPU-a"]),
                        ("held_mib_by_card", {"GPU-a": 1780}), ("held_mib_by_card", None)):
        assert not f.split_ok({**found, key: broken}, dry_run=False), key
    # The rehearsal's CPU engine holds no GPU memory: not asked of it.
    assert f.split_ok({**found, "held_mib_by_card": None}, dry_run=True)


def test_the_split_models_spec_is_one_the_catalog_takes() -> None:
    from llmgw.contract.catalog import CATALOG_MODEL

    f = fleet()
    starter = {"name": "qwen", "source": "https://mirror/q.gguf", "sha256": "",
               "profiles": [{"name": "gpu-h200", "engine": "llamacpp", "gpu_class": "h200",
                             "priority": 200, "args": ["--ctx-size", "4096"]},
                            {"name": "cpu", "engine": "llamacpp"}]}
    spec = CATALOG_MODEL.validate_python(f.split_spec(starter))
    (profile,) = spec["profiles"]
    assert (profile["gpus"], profile["args"]) == (2, ["--ctx-size", "4096", "--tensor-split",
                                                      "1,1"])


def test_the_fleets_line_has_a_split_goal_only_where_the_split_ran(tmp_path: Path) -> None:
    f = fleet()
    report = f.Report(tmp_path)
    f.finish(report, 0)
    assert "split_on_2_gpus" not in json.loads((tmp_path / "gpu-check.json").read_text())["goals"]
    report.data["split"] = {"ok": True, "gpus": ["GPU-a", "GPU-b"], "tokens_per_s_1": 90.0}
    f.finish(report, 0)
    line = json.loads((tmp_path / "gpu-check.json").read_text())
    assert line["goals"]["split_on_2_gpus"] is True and line["split_gpus"] == ["GPU-a", "GPU-b"]


# --- the RPC case (bench/gpu_rpc.py, --fleet's step 8) ---

def gpu_rpc() -> ModuleType:
    sys.path.insert(0, str(ROOT))
    try:
        from bench import gpu_rpc as module
    finally:
        sys.path.remove(str(ROOT))
    return module


def _rpc_only(tmp_path: Path, engine: str, rpc_server: str) -> dict:
    """`gpu-check --fleet --rpc-only --dry-run`, the small model, a .gpu-check of the CPU
    engine given (gzipped, as --prepare packs it; the tree is not used here) and an
    rpc-server beside the dry-run engine; the line it printed."""
    import gzip
    import shutil

    work, beside = tmp_path / "carried", tmp_path / "dry-run"
    work.mkdir()
    beside.mkdir()
    with open(engine, "rb") as f, gzip.open(work / "llama-server-cpu.gz", "wb") as out:
        shutil.copyfileobj(f, out)
    (work / "llama.cpp.tar.gz").write_bytes(b"not used by --rpc-only")
    (beside / "llama-server").symlink_to(engine)
    (beside / "rpc-server").symlink_to(rpc_server)
    done = run("--fleet", "--small", "--rpc-only", "--out", str(tmp_path / "out"),
               "--dry-run", str(beside / "llama-server"),
               env={"LLMGW_GPU_CHECK_DIR": str(work), "TMPDIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_rpc_case_answers_as_the_unsplit_model_through_the_tls_relay(
        tmp_path: Path, rpc_engine: tuple[str, str]) -> None:
    """Rehearsed with the CPU build's rpc-server standing in for the CUDA build's: the
    split engine's answer at temperature 0 is the unsplit one's; the main engine put the
    output layer and the last block (2 of 3) on the RPC device, which holds a model buffer;
    the rpc-server's log names the device it serves and the connections the relay carried
    (certificates made at run time, nothing refused); tokens/s of both are figures. The
    negative control: an rpc-server that exits at once fails the step, named in the line,
    and the goal is false."""
    line = _rpc_only(tmp_path, *rpc_engine)
    assert line["rpc_failed"] is None, line
    assert line["rpc_answer_equal"] is True and line["goals"]["rpc_matches_unsplit"] is True
    assert line["rpc_same_tokens"] == 256 and line["rpc_max_logprob_diff"] <= 0.01
    assert line["rpc_layers_offloaded"] == "2/3"
    (held,) = line["rpc_buffers_mib"]["model"].values()
    assert held > 0
    assert line["rpc_server_devices"] and line["rpc_server_devices"][0].startswith("CPU")
    assert line["rpc_split_tokens_per_s"] > 0 and line["rpc_unsplit_tokens_per_s"] > 0
    step = json.loads((tmp_path / "out" / "fleet.json").read_text())["rpc"]
    assert step["relay"]["carried"] >= 1 and step["relay"]["refused"] == []
    assert step["relay"]["bytes_to_worker"] > 0 and step["rpc_server_connections"] >= 1
    assert "Accepted client connection" in (tmp_path / "out" / "rpc-server.log").read_text()
    # The GPU main's flags (rpc_argv.gpu_main_flags), rehearsed with the dry-run engine
    # beside the rpc-server: taken, every layer offloaded, the same answer.
    assert line["rpc_gpu_main_failed"] is None and line["rpc_gpu_main_answer_equal"] is True
    assert line["rpc_gpu_main_layers_offloaded"] == "3/3", line
    assert "--tensor-split" in step["gpu_main"]["flags"]

    broken = tmp_path / "control"
    broken.mkdir()
    line = _rpc_only(broken, rpc_engine[0], "/bin/false")
    assert "rpc-server" in line["rpc_failed"] and "exited 1" in line["rpc_failed"]
    assert line["goals"]["rpc_matches_unsplit"] is False


def test_the_rpc_servers_devices_and_where_two_answers_part_are_read() -> None:
    r = gpu_rpc()
    log = ("Starting RPC server v7.0.0\n  endpoint       : 127.0.0.1:50052\n"
           "  local cache    : n/a\nDevices:\n"
           "  CUDA0: NVIDIA H200 (143771 MiB, 143000 MiB free)\n  transport      : TCP\n"
           "Accepted client connection\n")
    assert r.rpc_devices(log) == ["CUDA0: NVIDIA H200 (143771 MiB, 143000 MiB free)"]
    # Negative control: a log without its device list gives none, none made up.
    assert r.rpc_devices("Starting RPC server v7.0.0\n") == []
    assert r.parted_at("one two", "one two") is None
    assert r.parted_at("one two", "one tw0") == 6 and r.parted_at("one", "one two") == 3


def test_the_rpc_case_takes_the_rpc_server_of_a_cuda_build_with_the_rpc_backend(
        tmp_path: Path) -> None:
    """Only a CUDA build's -rpc folder is looked in: an earlier CUDA build's folder (no RPC
    backend) and the CPU build's are not, even with an rpc-server there."""
    r = gpu_rpc()
    builds = tmp_path / "llmgw" / "engines" / "llamacpp"
    for folder in ("0.3.36-rpc", "0.3.36-cuda13-sm90"):
        (builds / folder).mkdir(parents=True)
        (builds / folder / "rpc-server").write_text("#!/bin/sh\n")
        (builds / folder / "rpc-server").chmod(0o755)
    assert r.find_rpc_server([tmp_path / "llmgw"]) is None
    (builds / "0.3.36-cuda13-sm90-rpc").mkdir()
    made = builds / "0.3.36-cuda13-sm90-rpc" / "rpc-server"
    made.write_text("#!/bin/sh\n")
    made.chmod(0o755)
    assert r.find_rpc_server([tmp_path / "llmgw"]) == made


def test_the_fleets_line_has_an_rpc_goal_only_where_the_rpc_case_ran(tmp_path: Path) -> None:
    f = fleet()
    report = f.Report(tmp_path)
    f.finish(report, 0)
    goals = json.loads((tmp_path / "gpu-check.json").read_text())["goals"]
    assert "rpc_matches_unsplit" not in goals
    report.data["rpc"] = {"answer_equal": True, "split_tokens_per_s": 20.0,
                          "unsplit_tokens_per_s": 40.0, "split_unsplit": 0.5,
                          "tokens": {"matches": True, "same_tokens": 256}}
    f.finish(report, 0)
    line = json.loads((tmp_path / "gpu-check.json").read_text())
    assert line["goals"]["rpc_matches_unsplit"] is True and line["rpc_split_unsplit"] == 0.5
    # Negative control: answers that part (not at a tie) make the goal false.
    report.data["rpc"]["tokens"]["matches"] = False
    f.finish(report, 0)
    goals = json.loads((tmp_path / "gpu-check.json").read_text())["goals"]
    assert goals["rpc_matches_unsplit"] is False


def _token(tid: int, logprob: float, runner_up: float) -> dict:
    return {"id": tid, "logprob": logprob,
            "top_logprobs": [{"id": tid, "logprob": logprob},
                             {"id": tid + 1, "logprob": runner_up}]}


def test_split_and_unsplit_answers_match_token_by_token_or_part_only_at_a_near_tie() -> None:
    """The same tokens with log-probabilities within the tolerance match; answers that
    part where the unsplit one's top two were a near tie (0.004 nats) match too. The
    negative controls: parting where the choice was clear (2 nats), or a shared prefix
    whose log-probabilities differ by 0.5, do not."""
    r = gpu_rpc()
    a = [_token(1, -1.0, -3.0), _token(5, -2.000, -2.004)]
    b = [_token(1, -1.001, -3.0), _token(9, -2.001, -2.002)]
    assert r.compare(a, a) == {"tokens": 2, "same_tokens": 2, "max_logprob_diff": 0.0,
                               "matches": True}
    found = r.compare(a, b)
    assert found["same_tokens"] == 1 and found["gap_at_parting"] == 0.004
    assert found["parted_at_near_tie"] and found["matches"]
    clear = [_token(1, -1.0, -3.0), _token(5, -0.1, -2.1)]
    assert not r.compare(clear, b)["matches"]
    off = [_token(1, -1.5, -3.0), _token(5, -2.000, -2.004)]
    assert not r.compare(off, b)["matches"]
