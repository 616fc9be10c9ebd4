"""What a model's engine takes on a GPU, and how many slots (with how much context each)
fit a card's free memory: one formula from the GGUF's own geometry, which the agent sizes
a GPU replica by and the scheduler fits a card by.

The formula (bytes; the geometry is read from the file's header, contract.records.Geometry):

    per_token = layers x KV heads x (key width x K bytes + value width x V bytes)
                K/V bytes by the cache type (-ctk/-ctv): f16 2, q8_0 34/32, q4_0 18/32, ...;
                a head's width is key_length/value_length, else embedding / heads
    compute   = UBATCH x (4 x (3 x feed-forward + 4 x embedding) + 2 x ctx_per_slot)
                llama.cpp's compute buffer for one batch of UBATCH tokens: its activations
                at their widest (three F32 rows of the feed-forward width and four of the
                embedding's) and the attention mask over one slot's context (F16), flash
                attention on (the default); a feed-forward width the file does not say is
                taken as 4 x embedding. Against the buffers llama.cpp reports (CPU, this
                llama.cpp): 28.5 MiB for gpu-check's 270M shape at 4096 tokens a slot
                (it says 28.51), 3.25 MiB for the tests' tiny GGUF (it says 3.01).
                A profile that turns flash attention off (-fa off) adds the attention
                scores, UBATCH x ctx_per_slot x heads x 4 (F32)
    room      = free - weights - MARGIN - compute
                weights: the file's size; MARGIN: what llama.cpp's own --fit leaves free on a
                device (1 GiB), for the CUDA context and what else runs there
    slots     = min(MAX_SLOTS, floor(room / (per_token x ctx_per_slot)));  0: it does not fit

ctx_per_slot is the profile's --ctx-size where it names one, else DEFAULT_CTX_PER_SLOT;
either at most the model's training context. Without a --ctx-size in the profile, where
MAX_SLOTS slots leave room, the context per slot grows with it (a multiple of CTX_STEP),
up to the training context. The engine is then given `--parallel slots --ctx-size slots
x ctx_per_slot` (llama.cpp splits the context evenly among its slots). A profile that
names --parallel itself is not sized: its --ctx-size (else the training context) is the
whole cache. A profile's --ubatch-size stands for UBATCH.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the catalog reads a profile's split flags from here
    from llmgw.contract.records import Geometry

MIB = 1 << 20
GIB = 1 << 30
# llama.cpp's default physical batch (-ub): its compute buffer is reserved for one.
UBATCH = 512
# llama.cpp's --fit leaves this much of each device free (common.h fit_params_target).
MARGIN = GIB
# The gateway holds at most as many connections to one replica
# (engine_args.MAX_CONNECTIONS_PER_REPLICA): slots beyond them would idle.
MAX_SLOTS = 64
DEFAULT_CTX_PER_SLOT = 8192
CTX_STEP = 256
# Bytes per cache element by llama.cpp's cache type (-ctk / -ctv); a quantized block of 32
# values carries its scale(s) beside them.
CACHE_TYPE_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32,
                    "q4_1": 20 / 32, "q5_0": 22 / 32, "q5_1": 24 / 32, "iq4_nl": 18 / 32}
CTX_FLAGS = ("-c", "--ctx-size")
PARALLEL_FLAGS = ("-np", "--parallel")
CACHE_K_FLAGS = ("-ctk", "--cache-type-k")
CACHE_V_FLAGS = ("-ctv", "--cache-type-v")
UBATCH_FLAGS = ("-ub", "--ubatch-size")
FLASH_ATTN_FLAGS = ("-fa", "--flash-attn")


def arg_value(args: list[str], names: tuple[str, ...]) -> str:
    """The value of the last of names in args ('' when absent)."""
    found = ""
    for i, word in enumerate(args[:-1]):
        if word in names:
            found = args[i + 1]
    return found


def _positive(text: str) -> int:
    return int(text) if text.isdigit() and int(text) > 0 else 0


def kv_bytes_per_token(geometry: Geometry, args: list[str] | None = None) -> float:
    """What one token of context takes in the KV cache (K and V, every layer); 0 when the
    geometry is unknown."""
    layers, heads = geometry.get("block_count", 0), geometry.get("head_count", 0)
    if not (layers and heads):
        return 0.0
    kv_heads = geometry.get("head_count_kv") or heads
    key = geometry.get("key_length") or geometry.get("embedding_length", 0) // heads
    value = geometry.get("value_length") or key
    k = CACHE_TYPE_BYTES.get(arg_value(args or [], CACHE_K_FLAGS), 2.0)
    v = CACHE_TYPE_BYTES.get(arg_value(args or [], CACHE_V_FLAGS), 2.0)
    return float(layers * kv_heads * (key * k + value * v))


def compute_bytes(geometry: Geometry, ctx_per_slot: int, args: list[str] | None = None) -> int:
    """llama.cpp's compute buffer for one batch (module docstring)."""
    embedding = geometry.get("embedding_length", 0)
    feed_forward = geometry.get("feed_forward_length") or 4 * embedding
    ubatch = _positive(arg_value(args or [], UBATCH_FLAGS)) or UBATCH
    scores = 0
    if arg_value(args or [], FLASH_ATTN_FLAGS) in ("off", "0", "false"):
        scores = 4 * ctx_per_slot * geometry.get("head_count", 0)
    return ubatch * (4 * (3 * feed_forward + 4 * embedding) + 2 * ctx_per_slot + scores)


@dataclass(frozen=True)
class Sizing:
    """Slots and context per slot on a card, and what they take (bytes): the KV cache holds
    cache_tokens. slots 0: it does not fit, and the figures are what the least it runs
    with would need (one slot, for a profile sized here)."""

    slots: int
    ctx_per_slot: int
    cache_tokens: int
    weights: int
    kv: int
    compute: int
    free: int
    margin: int = MARGIN

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute + self.margin

    def fits(self) -> bool:
        return self.slots > 0

    def args(self) -> list[str]:
        """The engine flags of this sizing."""
        return ["--parallel", str(self.slots), "--ctx-size", str(self.slots * self.ctx_per_slot)]

    def explain(self) -> str:
        """'W weights + C compute + K KV cache for T tokens + M margin' (GiB)."""
        return (f"{_gib(self.weights)} weights + {_gib(self.compute)} compute + "
                f"{_gib(self.kv)} KV cache for {self.cache_tokens} tokens + "
                f"{_gib(self.margin)} margin")


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def sized(args: list[str]) -> bool:
    """Whether a GPU profile's slots are llmgw's to choose: it names no --parallel."""
    return not any(a in PARALLEL_FLAGS for a in args)


def ctx_wanted(geometry: Geometry, args: list[str]) -> int:
    """The context per slot to size for: the profile's --ctx-size, else
    DEFAULT_CTX_PER_SLOT; at most the training context."""
    wanted = _positive(arg_value(args, CTX_FLAGS)) or DEFAULT_CTX_PER_SLOT
    trained = geometry.get("context_length", 0)
    return min(wanted, trained) if trained else wanted


def size(geometry: Geometry, weights: int, free: int, args: list[str]) -> Sizing | None:
    """The slots of a GPU replica on a card with `free` bytes (module docstring); None when
    the geometry is unknown (nothing to size by)."""
    per_token = kv_bytes_per_token(geometry, args)
    if not per_token:
        return None
    if not sized(args):
        return _as_given(geometry, weights, free, args, per_token)
    ctx = ctx_wanted(geometry, args)
    room = free - weights - MARGIN - compute_bytes(geometry, ctx, args)
    slots = max(0, min(MAX_SLOTS, int(room // (per_token * ctx))))
    if slots == MAX_SLOTS and not _positive(arg_value(args, CTX_FLAGS)):
        ctx = _grown(geometry, weights, free, per_token, ctx, args)
    tokens = max(slots, 1) * ctx
    return Sizing(slots, ctx, tokens, weights, int(per_token * tokens),
                  compute_bytes(geometry, ctx, args), free)


def _grown(geometry: Geometry, weights: int, free: int, per_token: float, ctx: int,
           args: list[str]) -> int:
    """The context per slot MAX_SLOTS slots can have, from ctx up to the training context."""
    trained = geometry.get("context_length", 0)
    if not trained or trained <= ctx:
        return ctx
    room = free - weights - MARGIN - compute_bytes(geometry, trained, args)
    fits = int(room // (per_token * MAX_SLOTS)) // CTX_STEP * CTX_STEP
    return max(ctx, min(trained, fits))


def _as_given(geometry: Geometry, weights: int, free: int, args: list[str],
              per_token: float) -> Sizing:
    """A profile that names --parallel: its --ctx-size (else the training context) is the
    whole cache, split among its slots."""
    slots = _positive(arg_value(args, PARALLEL_FLAGS)) or 1
    total = _positive(arg_value(args, CTX_FLAGS)) or geometry.get("context_length", 0) \
        or DEFAULT_CTX_PER_SLOT
    ctx = max(total // slots, 1)
    kv = int(per_token * total)
    compute = compute_bytes(geometry, ctx, args)
    fits = weights + kv + compute + MARGIN <= free
    return Sizing(slots if fits else 0, ctx, total, weights, kv, compute, free)


def engine_args(args: list[str], sizing: Sizing | None) -> list[str]:
    """args with the sizing's --parallel and --ctx-size in place of the profile's
    --ctx-size (read as the context per slot); args as they are when not sized."""
    if sizing is None or not sizing.fits() or not sized(args):
        return list(args)
    kept: list[str] = []
    words = iter(args)
    for word in words:
        if word in CTX_FLAGS:
            next(words, None)
            continue
        kept.append(word)
    return [*kept, *sizing.args()]


# --- one replica over several cards: llama.cpp's layer split ---
#
# llama.cpp (--split-mode layer; llama_model::load_tensors) gives each card a contiguous run
# of the model's n_layer + 1 "units": the repeating layers 0..n_layer-1 and then the output
# layer (the output norm and matrix; the token embeddings stay on the CPU). With the
# tensor split's running sums normalised to split points s_0 < ... < s_{n-1} = 1, unit il
# goes to the first card whose s_d > il / (n_layer + 1). A layer's KV cache lives on the
# card of its layer; each card holds its own compute buffer and keeps llama.cpp's margin.
# The file's bytes are taken as spread evenly over the units (the GGUF header says no
# more), so each card's weights are its units x size / (n_layer + 1).

SPLIT_MODE_FLAGS = ("-sm", "--split-mode")
TENSOR_SPLIT_FLAGS = ("-ts", "--tensor-split")


def layer_units(proportions: list[float], units: int) -> list[int]:
    """How many of `units` (the repeating layers and the output layer) each card gets for a
    --tensor-split of proportions, by llama.cpp's rule (above); the output layer is the
    last unit, so it goes to the last card that gets any."""
    total = float(sum(proportions)) or 1.0
    points, running = [], 0.0
    for p in proportions:
        running += p
        points.append(running / total)
    counts = [0] * len(proportions)
    for il in range(units):
        card = bisect.bisect_right(points, il / units)
        counts[min(card, len(counts) - 1)] += 1
    return counts


def tensor_split(args: list[str]) -> list[float]:
    """The profile's own --tensor-split as numbers ([] when it names none)."""
    given = arg_value(args, TENSOR_SPLIT_FLAGS)
    try:
        return [float(v) for v in re.split(r"[,/]+", given)] if given else []
    except ValueError:
        return []


@dataclass(frozen=True)
class Share:
    """One card's part of a split replica (bytes): the units it holds (repeating layers, and
    the output layer on the last), and what they take with its compute buffer and margin."""

    free: int
    layers: int
    output: bool
    weights: int
    kv: int
    compute: int
    margin: int = MARGIN

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute + self.margin

    def explain(self) -> str:
        held = f"{self.layers} layers" + (" and the output layer" if self.output else "")
        return (f"{_gib(self.free)} free; its share ({held}) needs {_gib(self.total)}: "
                f"{_gib(self.weights)} weights + {_gib(self.kv)} KV cache + "
                f"{_gib(self.compute)} compute + {_gib(self.margin)} margin")


@dataclass(frozen=True)
class Split:
    """A replica's slots over several cards and each card's share; slots 0: it does not
    fit, and the shares are what one slot would need (the profile's own slots where it
    names --parallel). proportions: the --tensor-split the shares follow."""

    slots: int
    ctx_per_slot: int
    cache_tokens: int
    shares: tuple[Share, ...]
    proportions: tuple[int | float, ...]
    sized: bool = True

    def fits(self) -> bool:
        return self.slots > 0

    def args(self, given: list[str]) -> list[str]:
        """given with the split's flags (--split-mode layer and its --tensor-split, unless
        the profile names its own) and, where llmgw sizes the slots, --parallel and
        --ctx-size in place of the profile's --ctx-size."""
        out = list(given)
        if self.sized and self.fits():
            out = engine_args(given, Sizing(self.slots, self.ctx_per_slot, 0, 0, 0, 0, 0))
        if not any(a in SPLIT_MODE_FLAGS for a in given):
            out += ["--split-mode", "layer"]
        if not any(a in TENSOR_SPLIT_FLAGS for a in given):
            out += ["--tensor-split", ",".join(_number(p) for p in self.proportions)]
        return out

    def explain(self, names: list[str]) -> str:
        """'NAME: share; NAME: share' (each card's, in order)."""
        return "; ".join(f"{n} has {s.explain()}" for n, s in zip(names, self.shares, strict=True))


def _number(p: int | float) -> str:
    return str(int(p)) if float(p).is_integer() else f"{p:g}"


def room(geometry: Geometry, free: int, args: list[str]) -> int:
    """What a card gives a split replica (MiB): its free memory less llama.cpp's margin and
    one compute buffer; the --tensor-split llmgw passes is these, card by card."""
    compute = compute_bytes(geometry, ctx_wanted(geometry, args), args)
    return max(0, (free - MARGIN - compute) // MIB)


def size_split(geometry: Geometry, weights: int, frees: list[int],
               args: list[str]) -> Split | None:
    """A replica over cards with `frees` bytes free, in the order the engine numbers them:
    layers split by the profile's --tensor-split, else by each card's room(); slots the
    most every card holds its share of (at most MAX_SLOTS, the context per slot as size()
    gives it, without growing it). None when the geometry is unknown."""
    per_token = kv_bytes_per_token(geometry, args)
    layers = geometry.get("block_count", 0)
    if not per_token or not layers:
        return None
    proportions: tuple[int | float, ...] = tuple(tensor_split(args)[:len(frees)])
    if len(proportions) != len(frees) or not any(proportions):
        proportions = tuple(room(geometry, f, args) for f in frees)
    cut = _Cut(geometry, weights, frees, args,
               layer_units([float(p) for p in proportions], layers + 1), per_token / layers)
    if not sized(args):
        slots = _positive(arg_value(args, PARALLEL_FLAGS)) or 1
        total = _positive(arg_value(args, CTX_FLAGS)) or geometry.get("context_length", 0) \
            or DEFAULT_CTX_PER_SLOT
        ctx = max(total // slots, 1)
        shares = cut.shares(ctx, slots)
        fits = all(s.total <= s.free for s in shares)
        return Split(slots if fits else 0, ctx, slots * ctx, shares, proportions, sized=False)
    ctx = ctx_wanted(geometry, args)
    one = cut.shares(ctx, 1)
    slots = max(0, min(_slots_held(share) for share in one))
    return Split(slots, ctx, max(slots, 1) * ctx,
                 one if slots <= 1 else cut.shares(ctx, slots), proportions)


def _slots_held(share: Share) -> int:
    """How many slots (at most MAX_SLOTS) a card holds its share of; share is for one."""
    left = share.free - share.weights - share.compute - share.margin
    if not share.kv:
        return MAX_SLOTS if left >= 0 else 0
    return min(MAX_SLOTS, int(left // share.kv))


@dataclass(frozen=True)
class _Cut:
    """A model cut over cards: their free bytes and the units (layer_units) each holds."""

    geometry: Geometry
    weights: int
    frees: list[int]
    args: list[str]
    units: list[int]
    per_layer_token: float

    def shares(self, ctx: int, slots: int) -> tuple[Share, ...]:
        """Each card's share with slots of ctx tokens (the last card with any units holds
        the output layer, which has no KV cache)."""
        total_units = sum(self.units)
        last = max((i for i, n in enumerate(self.units) if n), default=-1)
        compute = compute_bytes(self.geometry, ctx, self.args)
        shares = []
        for i, (free, n) in enumerate(zip(self.frees, self.units, strict=True)):
            repeating = n - 1 if i == last else n
            shares.append(Share(free, repeating, i == last,
                                self.weights * n // max(total_units, 1),
                                int(self.per_layer_token * repeating * ctx * slots), compute))
        return tuple(shares)
