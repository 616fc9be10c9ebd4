"""Fixtures for the project's own tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.hosts import ThrowawayHost
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
