"""Fixtures for the project's own tests."""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.hosts import ThrowawayHost
from tests.postgres import PostgresServer, bindir
from tests.tiny_gguf import write_tiny_gguf


@pytest.fixture
def make_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[], ThrowawayHost]]:
    """Function: a factory of throwaway hosts; every one made is brought down afterwards."""
    made: list[ThrowawayHost] = []

    def make() -> ThrowawayHost:
        host = ThrowawayHost(Path(tmp_path_factory.mktemp("host")) / "state")
        made.append(host)
        return host

    yield make
    for host in made:
        host.down()


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """Session: a tiny llama GGUF made at test time, and its sha256."""
    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    return path, write_tiny_gguf(path)


@pytest.fixture(scope="session")
def llama_server() -> str:
    """Session: a llama-server binary, found the way a node finds one (configured, PATH,
    cache) or built from the pinned source the first time (about 11 minutes on 2 cores)."""
    from llmgw.agent.engines.cpu import LlamaCpp
    from llmgw.config import EngineConfig

    engine = LlamaCpp(EngineConfig())
    status = engine.provision()
    assert status["state"] == "ready", f"no llama-server for the tests: {status['detail']}"
    assert engine.found is not None
    return str(engine.found.path)


@pytest.fixture(scope="session")
def rpc_engine() -> tuple[str, str]:
    """Session: (llama-server, rpc-server) of the source build with llama.cpp's RPC backend
    (GGML_RPC=ON), found in the cache or built the way a node builds it (the prebuilt
    engine has no RPC backend)."""
    from llmgw.agent.engines.cpu import LlamaCpp
    from llmgw.config import EngineConfig

    engine = LlamaCpp(EngineConfig())
    found = engine.locate()
    if found is None or engine.rpc_server_of(found) is None:
        found = engine.build()
    rpc_server = engine.rpc_server_of(found)
    assert rpc_server is not None, f"the build at {found.path.parent} has no rpc-server"
    return str(found.path), str(rpc_server)


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="session")
def served_gguf(tiny_gguf) -> Iterator[tuple[str, str]]:
    """Session: the tiny GGUF over http on loopback (the agent reads no file:// source),
    and its sha256."""
    path, digest = tiny_gguf
    server = ThreadingHTTPServer(("127.0.0.1", 0),
                                 functools.partial(_Quiet, directory=str(path.parent)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/{path.name}", digest
    server.shutdown()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """Session: a real PostgreSQL server on loopback (tests/postgres.py), started on first
    use and removed at the end. Skipped, saying what to install, where PostgreSQL is not
    installed and this is not root; as root (CI) `scripts/bootstrap` installs it, and its
    absence fails."""
    binaries = bindir()
    if binaries is None:
        why = ("PostgreSQL is not installed (no pg_config, no /usr/lib/postgresql/*/bin): "
               "`apt-get install postgresql`, or run scripts/bootstrap as root")
        if os.geteuid() == 0:
            pytest.fail(why)
        pytest.skip(why)
    server = PostgresServer(binaries)
    try:
        server.start()
    except BaseException:
        server.remove()
        raise
    yield server
    server.remove()


@pytest.fixture
def postgres_url(postgres_server: PostgresServer) -> str:
    """Function: the URL of a new, empty database on the session's PostgreSQL server."""
    return postgres_server.create_database()


@pytest.fixture
def postgres_password_url(postgres_server: PostgresServer) -> str:
    """Function: the URL of a new, empty database on the session's PostgreSQL server whose
    user must give its password (in the URL: change it to see a wrong one refused)."""
    return postgres_server.create_database_with_password()
