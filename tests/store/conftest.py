"""The store's tests run on both backends: a SQLite file and a real PostgreSQL database."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from llmgw.store import Store


@pytest.fixture(params=["sqlite", "postgresql"])
def store_at(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Function: where a new store is, once a SQLite file, once a PostgreSQL database."""
    if request.param == "sqlite":
        return str(tmp_path / "control.db")
    url: str = request.getfixturevalue("postgres_url")
    return url


@pytest.fixture
def open_store(store_at: str) -> Iterator[Callable[..., Store]]:
    """Function: opens the test's store (more than once: several processes' view of one);
    every one opened is closed afterwards."""
    opened: list[Store] = []

    def open_(**options: Any) -> Store:
        store = Store(store_at, **options)
        opened.append(store)
        return store

    yield open_
    for store in opened:
        store.close()
