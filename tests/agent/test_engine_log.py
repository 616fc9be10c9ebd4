"""Engine logs: capped by copy-and-truncate under an appending writer, tailed, pruned late."""

from __future__ import annotations

import os
import time

from llmgw.agent.replicas import log as engine_log


def test_a_log_over_the_cap_rotates_and_the_writer_keeps_appending(tmp_path) -> None:
    log = tmp_path / "r1.log"
    with open(log, "ab", buffering=0) as engine:  # the engine's own fd, opened for append
        engine.write(b"old line\n" * 200)
        assert not engine_log.rotate(log, max_bytes=10_000)
        assert engine_log.rotate(log, max_bytes=1000)
        engine.write(b"new line\n")
    assert log.read_bytes() == b"new line\n"
    assert (tmp_path / "r1.log.1").read_bytes() == b"old line\n" * 200


def test_the_tail_is_bounded_and_reaches_into_the_rotated_generation(tmp_path) -> None:
    log = tmp_path / "r1.log"
    (tmp_path / "r1.log.1").write_text("".join(f"old {i}\n" for i in range(10)))
    log.write_text("new 0\n")
    assert engine_log.tail(log, lines=3) == ["old 8", "old 9", "new 0"]
    log.write_text("x" * 100_000 + "\nlast\n")
    got = engine_log.tail(log, lines=5, max_bytes=1000)
    assert got[-1] == "last" and sum(len(line) for line in got) <= 1000


def test_logs_of_replicas_gone_an_hour_are_pruned_and_others_kept(tmp_path) -> None:
    for name in ("live.log", "stopped.log", "stopped.log.1", "recent.log"):
        (tmp_path / name).write_text("x\n")
    hour_ago = time.time() - 4000
    for name in ("live.log", "stopped.log", "stopped.log.1"):
        os.utime(tmp_path / name, (hour_ago, hour_ago))
    removed = engine_log.prune(tmp_path, {"live"})
    assert sorted(removed) == ["stopped.log", "stopped.log.1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["live.log", "recent.log"]


# llama.cpp's lines for a model that does not fit its card (b7xxx, llama-server): the
# allocation ggml-cuda.cu refused, then the load that failed for it.
OOM_LOG = "".join(line + "\n" for line in [
    "load_tensors: offloading 24 repeating layers to GPU",
    "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 15316.00 MiB on device 0: "
    "cudaMalloc failed: out of memory",
    "alloc_tensor_range: failed to allocate CUDA0 buffer of size 16060055552",
    "llama_model_load: error loading model: unable to allocate CUDA0 buffer",
    "llama_model_load_from_file_impl: failed to load model",
    "common_init_from_params: failed to load model '/w/m.gguf'",
    "srv    load_model: failed to load model, '/w/m.gguf'",
    "main: exiting due to model loading error",
])


def test_an_out_of_memory_start_is_told_by_the_allocation_then_the_failed_load() -> None:
    reason = engine_log.failure_reason(OOM_LOG.splitlines())
    assert reason == ("ggml_backend_cuda_buffer_type_alloc_buffer: allocating 15316.00 MiB on "
                      "device 0: cudaMalloc failed: out of memory / llama_model_load: error "
                      "loading model: unable to allocate CUDA0 buffer")


def test_a_cuda_error_is_named_and_a_log_without_failure_lines_gives_nothing() -> None:
    assert engine_log.failure_reason(
        ["CUDA error: no CUDA-capable device is detected",
         "  current device: -1, in function ggml_cuda_init at ggml-cuda.cu:263"]) == \
        "CUDA error: no CUDA-capable device is detected"
    assert engine_log.failure_reason(["main: server is listening on http://127.0.0.1:1"]) == ""
