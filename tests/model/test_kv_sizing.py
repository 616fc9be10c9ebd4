"""The slot and memory formula (llmgw.model.kv_sizing) on real GGUF metadata: the tests' tiny
GGUF, and the 270M-class shape scripts/gpu-check serves on a GPU. Each expected value is
worked out by hand in the test's docstring."""

from __future__ import annotations

import re
import struct
import subprocess
import time
from importlib.machinery import SourceFileLoader
from importlib.util import module_from_spec, spec_from_loader
from pathlib import Path
from types import ModuleType

import pytest

from llmgw.host.netaddr import free_port
from llmgw.model import kv_sizing
from llmgw.model.ggufmeta import geometry
from llmgw.model.kv_sizing import GIB, MARGIN, MAX_SLOTS, engine_args, size
from tests.tiny_gguf import write_tiny_gguf

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20


def gpu_check() -> ModuleType:
    loader = SourceFileLoader("gpu_check", str(ROOT / "scripts" / "gpu-check"))
    spec = spec_from_loader("gpu_check", loader)
    assert spec is not None
    module = module_from_spec(spec)
    loader.exec_module(module)
    return module


def header_of_270m(path: Path) -> dict[str, int]:
    """A header-only GGUF (no tensors) of gpu-check's 270M shape, its keys written with
    gpu-check's own encoder: the metadata its model carries. Returns the shape."""
    gc = gpu_check()
    shape = dict(gc.MODEL_270M)
    tokens, _ = gc.vocab(shape["n_vocab"])
    kvs = [
        gc._kv("general.architecture", gc._GGUF_STRING, "llama"),
        gc._kv("llama.context_length", gc._GGUF_U32, shape["n_ctx"]),
        gc._kv("llama.embedding_length", gc._GGUF_U32, shape["n_embd"]),
        gc._kv("llama.block_count", gc._GGUF_U32, shape["n_layer"]),
        gc._kv("llama.feed_forward_length", gc._GGUF_U32, shape["n_ff"]),
        gc._kv("llama.attention.head_count", gc._GGUF_U32, shape["n_head"]),
        gc._kv("llama.attention.head_count_kv", gc._GGUF_U32, shape["n_head"]),
        gc._kv("tokenizer.ggml.model", gc._GGUF_STRING, "llama"),
        gc._kv("tokenizer.ggml.tokens", gc._GGUF_ARRAY, (gc._GGUF_STRING, tokens)),
    ]
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + b"".join(kvs))
    return shape


def test_the_tiny_gguf_is_read_whole_and_sized_to_the_byte(tmp_path: Path) -> None:
    """tests/tiny_gguf.py: 2 layers, 4 heads (4 KV heads), width 64 (head 16), feed-forward
    128, 2048 tokens of training context.

    per_token = 2 x 4 x (16 x 2 + 16 x 2) = 512 B (f16 K and V)
    ctx       = min(8192, 2048) = 2048 a slot
    compute   = 512 x (4 x (3 x 128 + 4 x 64) + 2 x 2048) = 512 x 6656 = 3,407,872 B
    64 slots  = 64 x 2048 x 512 = 67,108,864 B of KV cache
    So a card with weights + 1 GiB + 3,407,872 + 67,108,864 bytes free gives 64 slots of
    2048 (--parallel 64 --ctx-size 131072); one byte less gives 63."""
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    found = geometry(path)
    assert found == {"block_count": 2, "context_length": 2048, "head_count": 4,
                     "head_count_kv": 4, "embedding_length": 64, "feed_forward_length": 128}
    assert kv_sizing.kv_bytes_per_token(found) == 512
    assert kv_sizing.compute_bytes(found, 2048) == 3_407_872
    weights = path.stat().st_size
    enough = weights + MARGIN + 3_407_872 + 67_108_864
    sizing = size(found, weights, enough, [])
    assert sizing is not None
    assert (sizing.slots, sizing.ctx_per_slot, sizing.kv) == (64, 2048, 67_108_864)
    assert sizing.args() == ["--parallel", "64", "--ctx-size", "131072"]
    assert sizing.total == enough
    short = size(found, weights, enough - 1, [])
    assert short is not None and (short.slots, short.ctx_per_slot) == (63, 2048)


def test_gpu_checks_270m_shape_on_an_h200_and_on_an_8_gib_card(tmp_path: Path) -> None:
    """gpu-check's MODEL_270M: 16 layers, 16 heads (16 KV heads), width 1024 (head 64),
    feed-forward 2816, 4096 tokens of training context; its F16 file is about 543,000,000 B
    (the weights).

    per_token = 16 x 16 x (64 x 2 + 64 x 2) = 65,536 B (64 KiB)
    ctx       = min(8192, 4096) = 4096; a slot's cache = 65,536 x 4096 = 268,435,456 B
    compute   = 512 x (4 x (3 x 2816 + 4 x 1024) + 2 x 4096) = 512 x 58,368 = 29,884,416 B
                (llama.cpp's CPU build reports 28.5117 MiB for it)
    An H200 with 143,000 MiB free: room = 149,946,368,000 - 543,000,000 - 1,073,741,824
      - 29,884,416 = 148,299,741,760 B, 552 slots' worth: capped at 64 (a 16 GiB cache).
    A card with 8,000 MiB free: room = 8,388,608,000 - 543,000,000 - 1,073,741,824
      - 29,884,416 = 6,741,981,760 B: 25 slots (25.1), --ctx-size 102,400.
    With a q8_0 cache (34/32 B an element): per_token = 16 x 16 x 2 x 64 x 34/32 = 34,816 B,
    a slot 142,606,336 B: 47 slots (47.3) on the 8,000 MiB card."""
    shape = header_of_270m(tmp_path / "270m.gguf")
    assert shape == {"n_embd": 1024, "n_layer": 16, "n_ff": 2816, "n_head": 16,
                     "n_vocab": 32000, "n_ctx": 4096}, "gpu-check's shape changed: redo the sums"
    found = geometry(tmp_path / "270m.gguf")
    assert found["feed_forward_length"] == 2816 and found["block_count"] == 16
    assert kv_sizing.kv_bytes_per_token(found) == 65_536
    assert kv_sizing.compute_bytes(found, 4096) == 29_884_416
    weights = 543_000_000
    h200 = size(found, weights, 143_000 * MIB, [])
    assert h200 is not None
    assert (h200.slots, h200.ctx_per_slot, h200.kv) == (MAX_SLOTS, 4096, 16 * GIB)
    small = size(found, weights, 8_000 * MIB, [])
    assert small is not None and small.args() == ["--parallel", "25", "--ctx-size", "102400"]
    q8 = size(found, weights, 8_000 * MIB, ["-ctk", "q8_0", "-ctv", "q8_0"])
    assert q8 is not None and (q8.slots, q8.ctx_per_slot) == (47, 4096)


QWEN7 = {"block_count": 28, "context_length": 32768, "head_count": 28, "head_count_kv": 4,
         "embedding_length": 3584, "feed_forward_length": 18944}


def test_a_context_per_slot_grows_to_the_training_context_once_64_slots_fit() -> None:
    """Qwen2.5-7B's shape (57,344 B a token) with 8 GiB of weights: 8192-token slots fit
    64 times over on an 80,000 MiB card; the context per slot then grows with the room.
    compute at 32768 = 512 x (4 x (3 x 18944 + 4 x 3584) + 65536) = 179,306,496 B;
    room = 83,886,080,000 - 8,589,934,592 - 1,073,741,824 - 179,306,496 = 74,043,097,088;
    / (64 x 57,344) = 20,175.3 tokens, down to a multiple of 256: 19,968 a slot."""
    sizing = size(QWEN7, 8 * GIB, 80_000 * MIB, [])
    assert sizing is not None and (sizing.slots, sizing.ctx_per_slot) == (64, 19_968)
    # Negative control: a card with less room keeps the 8192-token slots, fewer of them.
    tight = size(QWEN7, 8 * GIB, 20_000 * MIB, [])
    assert tight is not None and tight.ctx_per_slot == 8192 and 0 < tight.slots < 64


def test_a_card_too_small_for_one_slot_does_not_fit_and_says_what_one_needs() -> None:
    sizing = size(QWEN7, 8 * GIB, 9 * GIB, [])
    assert sizing is not None and not sizing.fits() and sizing.slots == 0
    assert sizing.cache_tokens == 8192 and "KV cache for 8192 tokens" in sizing.explain()
    assert size({}, 8 * GIB, 80 * GIB, []) is None, "no geometry, nothing to size by"


def test_the_profiles_own_args_win() -> None:
    """--parallel in the profile: not sized, its --ctx-size is the whole cache. --ctx-size
    alone: the context of each slot (it does not grow), replaced by the sized whole."""
    given = ["-np", "4", "-c", "16384"]
    sizing = size(QWEN7, 8 * GIB, 80 * GIB, given)
    assert sizing is not None and (sizing.slots, sizing.ctx_per_slot) == (4, 4096)
    assert engine_args(given, sizing) == given
    per_slot = ["--ctx-size", "4096", "--temp", "0.2"]
    sizing = size(QWEN7, 8 * GIB, 80 * GIB, per_slot)
    assert sizing is not None and sizing.ctx_per_slot == 4096
    assert engine_args(per_slot, sizing) == ["--temp", "0.2", "--parallel", "64",
                                             "--ctx-size", str(64 * 4096)]


@pytest.mark.parametrize("cache", ["f16", "q8_0", "q4_0"])
def test_a_quantized_cache_never_takes_more_than_f16(cache: str) -> None:
    args = ["-ctk", cache, "-ctv", cache]
    assert kv_sizing.kv_bytes_per_token(QWEN7, args) <= kv_sizing.kv_bytes_per_token(QWEN7)


_BUFFER = re.compile(r"CPU (KV|compute) buffer size =\s*([\d.]+) MiB")


def _reported_buffers(engine: str, model: Path, args: list[str], log: Path) -> dict[str, float]:
    """The KV and compute buffers (MiB) llama-server reports once it listens (its last
    report of each: the first are its --fit dry run)."""
    port = free_port("127.0.0.1")
    with open(log, "wb") as out:
        proc = subprocess.Popen([engine, "-m", str(model), "--host", "127.0.0.1", "--port",
                                 str(port), "--device", "none", "-ngl", "0", "-v", *args],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while "listening on" not in log.read_text(errors="replace"):
            assert proc.poll() is None, log.read_text(errors="replace")[-2000:]
            assert time.monotonic() < deadline, "llama-server did not listen within 60 s"
            time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return {kind: float(mib) for kind, mib in _BUFFER.findall(log.read_text(errors="replace"))}


@pytest.mark.slow
def test_llama_cpp_allocates_what_the_formula_says(tmp_path: Path, llama_server: str) -> None:
    """The real engine, started with the sizing's own flags on the tiny GGUF, reports a KV
    cache of exactly the formula's size, and a compute buffer within 10 % of its estimate
    (the CPU build's: a device run compares CUDA's, scripts/gpu-check), flash attention on
    (3.25 MiB against 3.01) or off (19.25 MiB against 20.88). The control: with twice the
    slots, its KV cache is twice as large, as the formula says."""
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    found = geometry(path)
    weights = path.stat().st_size
    for slots, extra in ((4, []), (8, []), (4, ["-fa", "off"])):
        free = weights + MARGIN + kv_sizing.compute_bytes(found, 2048, extra) \
            + slots * 2048 * 512
        sizing = size(found, weights, free, extra)
        assert sizing is not None and sizing.slots == slots
        log = tmp_path / f"{slots}{''.join(extra)}.log"
        reported = _reported_buffers(llama_server, path, sizing.args() + extra, log)
        assert reported["KV"] == pytest.approx(sizing.kv / MIB, abs=0.01), reported
        assert reported["compute"] == pytest.approx(sizing.compute / MIB, rel=0.10), reported


def test_no_more_slots_than_the_gateway_holds_connections_to_a_replica() -> None:
    from llmgw.model.engine_args import MAX_CONNECTIONS_PER_REPLICA

    assert MAX_SLOTS == MAX_CONNECTIONS_PER_REPLICA


def test_kv_cache_is_two_by_layers_tokens_kv_heads_head_width_in_f16() -> None:
    def kv(geometry: dict[str, int], tokens: int, args: list[str] | None = None) -> int:
        return int(kv_sizing.kv_bytes_per_token(geometry, args) * tokens)

    assert kv(QWEN7, 32768) == 2 * 28 * 32768 * (4 * 128) * 2
    # key_length / value_length, where the file says them, win over width / heads.
    assert kv({**QWEN7, "key_length": 256, "value_length": 256}, 1024) == \
        2 * 28 * 1024 * (4 * 256) * 2
    # A quantized cache takes what its type takes (q8_0: 34 bytes a 32-value block).
    assert kv(QWEN7, 32768, ["-ctk", "q8_0", "-ctv", "q8_0"]) == \
        int(2 * 28 * 32768 * (4 * 128) * 34 / 32)
    assert kv({}, 32768) == 0


def test_the_context_a_slot_is_sized_for_is_the_profiles_else_8192_within_training() -> None:
    assert kv_sizing.ctx_wanted(QWEN7, ["--ctx-size", "16384"]) == 16384
    assert kv_sizing.ctx_wanted(QWEN7, []) == 8192
    assert kv_sizing.ctx_wanted({**QWEN7, "context_length": 2048}, ["-c", "4096"]) == 2048


def test_a_profiles_ubatch_size_sizes_the_compute_buffer() -> None:
    """512 x (4 x (3 x 18944 + 4 x 3584) + 2 x 8192) = 154,140,672 B at the default batch;
    twice that for -ub 1024."""
    assert kv_sizing.compute_bytes(QWEN7, 8192) == 154_140_672
    assert kv_sizing.compute_bytes(QWEN7, 8192, ["-ub", "1024"]) == 2 * 154_140_672
