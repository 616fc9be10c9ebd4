"""Two control planes of one fleet, for the fleet page's tests."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from llmgw.control.admin_api import make_admin_app
from llmgw.host import admin_token
from llmgw.store import Store
from tests.servers import serve_asgi


@dataclass
class Fleet:
    """Two control planes' admin APIs on one PostgreSQL store, each with its own Store
    (as two processes), behind real HTTP servers."""

    a: str
    b: str
    store: Store
    token: str


@pytest.fixture
def fleet(tmp_path: Path, postgres_url: str) -> Iterator[Fleet]:
    """Function: two control planes of one fleet (one admin token, one PostgreSQL store),
    their admin APIs served on free loopback ports."""
    token_path = tmp_path / "etc" / admin_token.TOKEN_FILE
    admin_token.ensure(token_path)
    hash_path = admin_token.hash_path_for(token_path)
    store_a, store_b = Store(postgres_url), Store(postgres_url)
    app_a = make_admin_app(store_a, node_timeout_s=30.0, token_hash=hash_path)
    app_b = make_admin_app(store_b, node_timeout_s=30.0, token_hash=hash_path)
    try:
        with serve_asgi(app_a) as a, serve_asgi(app_b) as b:
            yield Fleet(a, b, store_b, admin_token.read_token(token_path))
    finally:
        store_a.close()
        store_b.close()
