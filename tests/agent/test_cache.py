"""The engine cache's layout, spelled once (llmgw.agent.engines.cache): the folders on disk
stay where existing caches have them, and nothing else spells them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from llmgw.agent.engines import cache

ROOT = Path(__file__).resolve().parents[2]
# How the layout used to be spelled beside the one module: its roots and its folders.
SPELLINGS = re.compile(r'environ.get\("XDG_CACHE_HOME"|"/var/cache/llmgw[/"]|/ "engines"'
                       r'|/ "sources"|/ "cuda"|"toolchains"|"engines/llamacpp')


def test_the_folders_are_where_existing_caches_have_them() -> None:
    """A cache built before (the llama.cpp build takes 10 minutes) is found again."""
    root = Path("/r")
    assert cache.cpu_build(root, "0.3.36") / cache.BINARY == \
        root / "engines/llamacpp/0.3.36/llama-server"
    # The build with the RPC backend has a folder of its own, so the one above serves
    # until it is made.
    assert cache.cpu_build(root, "0.3.36", rpc=True) == root / "engines/llamacpp/0.3.36-rpc"
    assert cache.cuda_build(root, "0.3.36", ["90", "80"], 13) == \
        root / "engines/llamacpp/0.3.36-cuda13-sm90_80"
    assert cache.cuda_build(root, "0.3.36", ["90", "80"], 13, rpc=True) == \
        root / "engines/llamacpp/0.3.36-cuda13-sm90_80-rpc"
    assert cache.prebuilt(root, "xllamacpp", "0.2.0") == root / "engines/xllamacpp/0.2.0"
    assert cache.toolchains(root) == root / "cuda"
    assert cache.sdist(root, "0.3.36") == root / "sources/llama_cpp_python-0.3.36.tar.gz"
    assert cache.lock_file(root / "engines/llamacpp/0.3.36") == \
        root / "engines/llamacpp/.0.3.36.lock"
    assert cache.root_for("system") == Path("/var/cache/llmgw")


def test_the_user_cache_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache.root_for("local") == cache.user_root() == tmp_path / "llmgw"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache.user_root() == Path.home() / ".cache" / "llmgw"


def test_no_other_module_spells_the_layout() -> None:
    """src/, scripts/ and the tests' conftests read the layout from llmgw.agent.engines.cache; the
    scan's own control: it finds the spellings in that module."""
    files = [*(ROOT / "src").rglob("*.py"), *(ROOT / "scripts").iterdir(),
             *(ROOT / "tests").rglob("conftest.py")]
    spelled = sorted(str(f.relative_to(ROOT)) for f in files
                     if f.is_file() and SPELLINGS.search(f.read_text(errors="replace")))
    assert spelled == ["src/llmgw/agent/engines/cache.py"]
