"""The engine's order of sources, its cache, its checks and the states it reports."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from llmgw.agent.engines import _build
from llmgw.agent.engines.common import Found, record, recorded_engine, version_of
from llmgw.agent.engines.cpu import PINNED_VERSION, LlamaCpp
from llmgw.config import EngineConfig
from tests.agent.conftest import FakeBinary


def engine(tmp_path: Path, search_path: str, **config: str) -> LlamaCpp:
    cfg = EngineConfig(cache_dir=str(tmp_path / "cache"), **config)
    return LlamaCpp(cfg, state_dir=tmp_path / "state", search_path=search_path)


def test_configured_binary_comes_first(tmp_path: Path, fake_llama_server: FakeBinary) -> None:
    configured = fake_llama_server(tmp_path / "configured", build="1111")
    on_path = fake_llama_server(tmp_path / "bin", build="2222")
    e = engine(tmp_path, str(on_path.parent), llama_server=str(configured))
    status = e.provision()
    assert (status["state"], status["version"]) == ("ready", "b1111"), status
    assert e.found is not None and e.found.origin == "configured"


def test_path_comes_before_the_cache(tmp_path: Path, fake_llama_server: FakeBinary) -> None:
    on_path = fake_llama_server(tmp_path / "bin", build="2222")
    e = engine(tmp_path, str(on_path.parent))
    fake_llama_server(e.cached_binary.parent)
    assert e.provision()["version"] == "b2222"
    assert e.found is not None and e.found.path == on_path


def test_cached_build_is_reused_without_building(
    tmp_path: Path, fake_llama_server: FakeBinary
) -> None:
    """A cached build answers; no cmake is needed (the search path has none)."""
    e = engine(tmp_path, str(tmp_path / "empty"))
    cached = fake_llama_server(e.cached_binary.parent)
    assert cached == (tmp_path / "cache" / "engines" / "llamacpp" / f"{PINNED_VERSION}-rpc"
                      / "llama-server")
    status = e.provision()
    assert (status["state"], status["version"]) == ("ready", PINNED_VERSION), status
    assert e.found is not None and e.found.origin == "cache"
    assert recorded_engine(tmp_path / "state") == {
        "engine": "llamacpp", "version": PINNED_VERSION, "path": str(cached), "origin": "cache",
    }


# engine.json byte for byte as the agent wrote it before its engine status became one
# record (contract.records.EngineStatus): what an upgraded agent, and the node's checks, read.
OLDER_ENGINE_JSON = ('{\n  "engine": "llamacpp",\n  "version": "b1111",\n'
                     '  "path": "/opt/llama-server",\n  "origin": "configured"\n}\n')


def test_engine_json_of_an_older_agent_reads_and_is_written_the_same(tmp_path: Path) -> None:
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "engine.json").write_text(OLDER_ENGINE_JSON)
    assert recorded_engine(tmp_path / "old") == {
        "engine": "llamacpp", "version": "b1111", "path": "/opt/llama-server",
        "origin": "configured"}
    record(tmp_path / "new", Found(Path("/opt/llama-server"), "b1111", "configured"))
    assert (tmp_path / "new" / "engine.json").read_text() == OLDER_ENGINE_JSON
    (tmp_path / "old" / "engine.json").write_text(OLDER_ENGINE_JSON[:-4])  # the control
    assert recorded_engine(tmp_path / "old") is None


def test_configured_binary_that_is_missing_fails_with_the_fix(tmp_path: Path) -> None:
    e = engine(tmp_path, str(tmp_path / "empty"), llama_server=str(tmp_path / "nope"))
    status = e.provision()
    assert status["state"] == "failed"
    assert status["detail"] == (
        f"engine.llama_server in agent.yaml names {tmp_path / 'nope'}, which is not an "
        "executable file; fix the path or remove the key to let the agent find or build "
        "one, then restart the agent")


def test_no_binary_and_no_tools_is_unsupported_said_plainly(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    status = engine(tmp_path, str(tmp_path / "empty")).provision()
    assert status["state"] == "unsupported"
    assert "cmake" in status["detail"] and "C++ compiler" in status["detail"]
    assert "engine.llama_server" in status["detail"]


def test_binary_that_does_not_answer_fails_the_check(
    tmp_path: Path, fake_llama_server: FakeBinary
) -> None:
    e = engine(tmp_path, str(tmp_path / "empty"))
    fake_llama_server(e.cached_binary.parent, rc=3)
    status = e.provision()
    assert status["state"] == "failed" and "--version did not answer" in status["detail"]
    assert f"remove {e.cached_binary.parent}" in status["detail"]
    assert recorded_engine(tmp_path / "state") is None


def test_default_cache_is_outside_the_checkout(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    e = LlamaCpp(EngineConfig())
    assert e.cached_binary == (tmp_path / "llmgw/engines/llamacpp" / f"{PINNED_VERSION}-rpc"
                               / "llama-server")


def test_a_build_without_rpc_serves_until_the_rpc_build_is_in_the_cache(
        tmp_path: Path, fake_llama_server: FakeBinary) -> None:
    """A cache with only the earlier build (no RPC backend) is used as it is: it serves, and
    has no rpc-server. Once the RPC build is there, it is the one found, with rpc-server.
    The control is the second half: the same engine, the RPC build added, finds it."""
    e = engine(tmp_path, str(tmp_path / "empty"))
    old = fake_llama_server(tmp_path / "cache" / "engines" / "llamacpp" / PINNED_VERSION)
    assert e.provision()["state"] == "ready"
    assert e.found is not None and e.found.path == old and e.rpc_server is None
    new = fake_llama_server(tmp_path / "cache" / "engines" / "llamacpp"
                            / f"{PINNED_VERSION}-rpc")
    rpc = new.parent / "rpc-server"
    rpc.write_text("#!/bin/sh\n")
    rpc.chmod(0o755)
    assert e.provision()["state"] == "ready"
    assert e.found is not None and e.found.path == new and e.rpc_server == rpc


@pytest.mark.parametrize(("output", "name"), [
    ("version: 4242 (0c1e570)\nbuilt with cc", "b4242"),
    ("version: 0.5.0-dev (build 1, commit 0c1e570)", "0.5.0-dev"),
    ("nothing useful", "unknown"),
])
def test_version_names(output: str, name: str) -> None:
    assert version_of(output) == name


@pytest.mark.parametrize(("line", "percent"), [
    ("[40/206] Building CXX object common/arg.cpp.o", 19),
    ("[206/206] Linking CXX executable bin/llama-server", 100),
    ("[ 40%] Building CXX object ggml/src/ggml.c.o", 40),
    ("-- Configuring done", None),
    ("[0/0] nothing", None),
])
def test_build_percent(line: str, percent: int | None) -> None:
    assert _build.build_percent(line) == percent


def test_build_reports_states_from_a_fake_cmake(tmp_path: Path) -> None:
    """A source archive, a cmake that prints ninja steps and makes the binary: the states
    go building → checking → ready, the percent moves, and the binary lands in the cache."""
    tools = _fake_toolchain(tmp_path / "tools")
    source = _fake_source(tmp_path / "src")
    seen: list[str] = []
    e = LlamaCpp(EngineConfig(cache_dir=str(tmp_path / "cache"), source=str(source)),
                 search_path=f"{tools}:/usr/bin:/bin")
    original = e._say

    def spy(state: str, detail: str = "", version: str | None = None) -> None:
        seen.append(f"{state} {detail}".strip())
        original(state, detail, version)

    e._say = spy  # type: ignore[method-assign]
    status = e.provision()
    assert status["state"] == "ready", (status, seen)
    assert "building 50%" in seen and "building 100%" in seen, seen
    assert seen.index("building 50%") < seen.index("building 100%")
    assert seen[-2].startswith("checking") and seen[-1].startswith("ready")
    assert e.found is not None and e.found.origin == "built"
    assert e.cached_binary.stat().st_mode & stat.S_IXUSR
    assert e.rpc_server == e.cached_binary.parent / "rpc-server", "rpc-server is installed too"
    assert not list(e.cached_binary.parent.parent.glob("build-*")), "the build tree is removed"


def test_failed_build_names_its_log(tmp_path: Path) -> None:
    tools = _fake_toolchain(tmp_path / "tools", fail=True)
    source = _fake_source(tmp_path / "src")
    e = LlamaCpp(EngineConfig(cache_dir=str(tmp_path / "cache"), source=str(source)),
                 search_path=str(tools))
    status = e.provision()
    assert status["state"] == "failed", status
    assert "error: boom" in status["detail"] and "build.log" in status["detail"]


def _fake_source(tree: Path) -> Path:
    (tree / "tools" / "server").mkdir(parents=True)
    (tree / "tools" / "server" / "server.cpp").write_text("int main() {}\n")
    (tree / "CMakeLists.txt").write_text("project(llama.cpp)\n")
    return tree


def _fake_toolchain(bin_dir: Path, fail: bool = False) -> Path:
    """A cmake that configures silently and builds by printing [N/M] and writing the binary."""
    bin_dir.mkdir(parents=True)
    build = (
        'echo "error: boom"; exit 1' if fail else
        'echo "[1/2] Building CXX object a.o"; echo "[2/2] Linking CXX executable bin/llama-server"'
        '; mkdir -p "$2/bin"; printf \'#!/bin/sh\\necho "version: 1 (abc)" >&2\\n\' '
        '> "$2/bin/llama-server"; chmod +x "$2/bin/llama-server"'
        '; case "$*" in *ggml-rpc-server*) printf \'#!/bin/sh\\n\' > "$2/bin/ggml-rpc-server"'
        '; chmod +x "$2/bin/ggml-rpc-server";; esac'
    )
    (bin_dir / "cmake").write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = "--build" ]; then {build}; exit 0; fi\n'
        'echo "-- Configuring done"\n'
    )
    (bin_dir / "g++").write_text("#!/bin/sh\n")
    for tool in ("cmake", "g++"):
        (bin_dir / tool).chmod(0o755)
    return bin_dir
