"""A real build of llama-server from the pinned source, as a fresh machine (CI) does it."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from llmgw.agent.engines import _build, cache
from llmgw.agent.engines.common import run_quietly
from llmgw.agent.engines.cpu import PINNED_VERSION, LlamaCpp
from llmgw.config import EngineConfig

pytestmark = pytest.mark.slow


def test_engine_builds_from_the_pinned_source_and_answers(tmp_path: Path) -> None:
    """About 11 minutes on 2 cores. The downloaded source in the user's cache is reused
    (it is 76 MB); the build goes into a cache of its own, so the real cache is untouched."""
    if _build.missing_tools():
        pytest.skip(f"this machine lacks {', '.join(_build.missing_tools())}")
    own = tmp_path / "cache"
    known_sdist = cache.sdist(cache.user_root(), PINNED_VERSION)
    if known_sdist.exists():
        cache.sdist(own, PINNED_VERSION).parent.mkdir(parents=True)
        shutil.copy2(known_sdist, cache.sdist(own, PINNED_VERSION))
    engine = LlamaCpp(EngineConfig(cache_dir=str(own)))
    seen: list[str] = []
    engine.start()
    started = time.monotonic()
    while engine.status["state"] not in ("ready", "failed", "unsupported"):
        line = f"{engine.status['state']} {engine.status['detail']}"
        if not seen or seen[-1] != line:
            seen.append(line)
        time.sleep(1)
    took = time.monotonic() - started
    assert engine.status["state"] == "ready", (engine.status, seen[-5:])
    assert any(s.startswith("building ") and s.endswith("%") for s in seen), seen
    assert engine.found is not None and engine.found.origin == "built"
    rc, out = run_quietly([str(engine.cached_binary), "--version"])
    assert rc == 0 and "version" in out
    print(f"built llama-server {PINNED_VERSION} in {took:.0f}s")
