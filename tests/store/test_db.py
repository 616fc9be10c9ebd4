"""Opening a store: where it is, SQLite's reads beside a writer and its checkpoints, and
PostgreSQL reconnected to by itself after a restart."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from llmgw.store import Store, StoreError, answers, redacted, refusal, store_url
from tests.postgres import PostgresServer


def test_a_path_is_sqlite_and_a_postgresql_url_goes_through_psycopg() -> None:
    assert store_url("/var/lib/llmgw/control.db").get_backend_name() == "sqlite"
    assert store_url("sqlite:////x/control.db").database == "/x/control.db"
    url = store_url("postgresql://llmgw:s3cret@db:5432/llmgw")
    assert (url.drivername, url.host, url.database) == ("postgresql+psycopg", "db", "llmgw")
    assert "s3cret" not in redacted("postgresql://llmgw:s3cret@db:5432/llmgw")


@pytest.mark.parametrize("where", ["mysql://db/llmgw", "sqlite://", "http://x"])
def test_a_store_llmgw_cannot_keep_is_refused_naming_what_it_can(where: str) -> None:
    with pytest.raises(ValueError, match="SQLite .* or PostgreSQL"):
        store_url(where)


def test_reads_do_not_wait_for_a_writer(tmp_path: Path) -> None:
    """A reader on another thread reads while a write transaction is open (WAL, no lock)."""
    store = Store(tmp_path / "db")
    store.record_heartbeat("n1", {})
    read: list[int] = []
    with store.db.tx() as conn:
        conn.exec_driver_sql("UPDATE nodes SET last_seen = 0")
        t = threading.Thread(target=lambda: read.append(len(store.nodes())))
        t.start()
        t.join(timeout=5)
    assert read == [1]
    store.close()


def test_the_log_is_checkpointed_off_the_writer(tmp_path: Path) -> None:
    """Commits never checkpoint (a heartbeat must not wait for a sync); checkpoint() does."""
    store = Store(tmp_path / "db")
    for i in range(2000):
        store.record_heartbeat(f"n{i}", {"pad": "x" * 500})
    wal = tmp_path / "db-wal"
    grown = wal.stat().st_size
    assert grown > 1000 * 4096, "past the default threshold, no commit checkpointed"
    store.checkpoint()
    again = Store(tmp_path / "db")
    assert len(again.nodes()) == 2000
    again.close()
    store.close()


def test_postgresql_is_reconnected_to_after_a_restart_and_nodes_are_heard_from_then(
        postgres_server: PostgresServer, caplog: pytest.LogCaptureFixture) -> None:
    """While the server is away no node can beat: once it answers, silence is counted from
    then (as after a restart of the control plane), not from the last beat."""
    now = [1000.0]
    store = Store(postgres_server.create_database(), clock=lambda: now[0])
    store.record_heartbeat("n1", {})
    assert store.reachable() == ""
    postgres_server.stop()
    try:
        with pytest.raises(StoreError):
            store.nodes()
        assert "cannot be reached" in store.reachable()
        assert store.db.unreachable_since is not None
        assert "trying again" in caplog.text, "an open store says it goes on without it"
        now[0] = 1100.0
    finally:
        postgres_server.start()
    assert [n["id"] for n in store.nodes()] == ["n1"], "the pool's dead connections replaced"
    assert (store.hearing.since, store.hearing.last_before) == (1100.0, 1000.0)
    assert store.db.unreachable_since is None
    store.record_heartbeat("n2", {})
    assert len(store.nodes()) == 2
    store.close()


def test_an_unreachable_store_is_not_an_outage_until_it_fails(
        postgres_server: PostgresServer) -> None:
    """The negative control: without an outage, hearing stays as the store opened it."""
    store = Store(postgres_server.create_database(), clock=lambda: 5.0)
    store.record_heartbeat("n1", {})
    before = store.hearing
    store.nodes()
    assert store.hearing is before
    store.close()


def test_a_store_that_cannot_be_opened_is_the_callers_error_in_one_line(
        postgres_server: PostgresServer, caplog: pytest.LogCaptureFixture) -> None:
    """No `trying again` warning from a store never opened (the caller exits, saying why),
    and refusal() is one line: the driver's reason and what to do, the password hidden."""
    from tests.postgres import PASSWORD

    url = postgres_server.create_database_with_password()
    wrong = url.replace(PASSWORD, "not-it")
    with pytest.raises(StoreError) as refused:
        Store(wrong)
    assert not caplog.records, caplog.text
    said = refusal(refused.value, wrong)
    assert said.startswith("the store postgresql://127.0.0.1:")
    assert 'refused: password authentication failed for user "llmgw_pw"; check the user' \
        in said and "\n" not in said and "not-it" not in said
    assert answers(wrong) == said, "answers() says the same without opening a Store"
    assert answers(url) == "", "control: the right password"
    assert answers("/nowhere/control.db") == "", "a SQLite file is made when first opened"


def test_a_failed_statement_is_the_stores_own_error_and_a_taken_name_a_conflict(
        tmp_path: Path) -> None:
    """Callers catch llmgw's StoreError (an llmgw.errors.Error), never SQLAlchemy's: it
    keeps SQLAlchemy's as its cause and the driver's reason as orig; a unique key's refusal
    is a StoreConflict. The control: an error of the caller's own inside a transaction
    leaves as itself."""
    import sqlalchemy as sa

    from llmgw.errors import Error
    from llmgw.store import StoreConflict

    store = Store(tmp_path / "control.db")
    try:
        with pytest.raises(StoreError) as failed:
            store.db.read(sa.text("SELECT * FROM nowhere"))
        assert isinstance(failed.value, Error)
        assert isinstance(failed.value.__cause__, sa.exc.OperationalError)
        assert "no such table: nowhere" in str(failed.value.orig)
        with pytest.raises(StoreConflict):
            with store.db.tx() as conn:
                for _ in range(2):
                    conn.execute(sa.text("INSERT INTO models (name, spec, created) "
                                         "VALUES ('m', '{}', 0)"))
        with pytest.raises(KeyError), store.db.tx():
            raise KeyError("the caller's")
    finally:
        store.close()
