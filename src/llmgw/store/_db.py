"""Opening the store: one location (a SQLite file or a PostgreSQL URL), its connections, its
transactions, and its schema brought to this code's revision.

SQLite (the embedded default): writes go through one connection under a lock, each a
`BEGIN IMMEDIATE` transaction, so a writer never waits half-way for another process's lock;
each read opens its own connection in autocommit (WAL lets each statement read a snapshot
beside a writer). PostgreSQL: a pool through psycopg 3, connections checked before use so a
restarted server is reconnected to by itself; writes under the same process lock (the
database orders them between processes).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, RowMapping
from sqlalchemy.exc import SQLAlchemyError

from llmgw.errors import Error, shown_url

log = logging.getLogger("llmgw.store")
# Alembic says each plugin it sets up (as it is imported) and each step at INFO; the store
# says what changed. Set before the first import of alembic, below.
logging.getLogger("alembic").setLevel(logging.WARNING)

from alembic import command  # noqa: E402
from alembic.config import Config  # noqa: E402
from alembic.runtime.migration import MigrationContext  # noqa: E402
from alembic.script import ScriptDirectory  # noqa: E402

# A store made before migrations existed has its columns completed, then the baseline
# (migrations/versions/0001_baseline.py, which creates only what is missing) stamps it.
_MIGRATIONS = str(Path(__file__).with_name("migrations"))
# Taken by a PostgreSQL migration so two control planes starting at once migrate in turn.
_MIGRATION_LOCK = 0x6C6D6777  # "lmgw"
# Columns added before migrations existed; a store from then gains them when stamped.
_LEGACY_COLUMNS = {
    "nodes": {"serial": "TEXT NOT NULL DEFAULT ''", "inv_version": "INTEGER NOT NULL DEFAULT 0"},
    "replicas": {"gpus": "TEXT NOT NULL DEFAULT '[]'"},
}


class StoreError(Error):
    """A read or a write the store could not do: it is unreachable, busy or broken (the
    gateway and the usage writer catch it and go on from what they had). Raised from
    SQLAlchemy's error, which stays its __cause__; orig is the driver's exception, and
    unreachable says whether the database did not answer at all."""

    def __init__(self, e: SQLAlchemyError) -> None:
        super().__init__(str(e))
        self.orig: BaseException | None = getattr(e, "orig", None)
        self.unreachable = isinstance(e, (sa.exc.OperationalError, sa.exc.InterfaceError))


class StoreConflict(StoreError):
    """A write a unique key refused: the name or id it gives is taken."""


@contextmanager
def _ours() -> Iterator[None]:
    """SQLAlchemy's errors, raised inside the block, as the store's own."""
    try:
        yield
    except sa.exc.IntegrityError as e:
        raise StoreConflict(e) from e
    except SQLAlchemyError as e:
        raise StoreError(e) from e


class SchemaError(Error):
    """The store's schema is not the one this code reads; says which and what to do."""


def store_url(where: str | Path) -> sa.URL:
    """The SQLAlchemy URL of a store: a path is a SQLite file; `sqlite:///PATH` too;
    `postgresql://…` (or `postgresql+psycopg://…`) a PostgreSQL database through psycopg 3.
    ValueError, naming what was given, for anything else."""
    text = str(where)
    if "://" not in text:
        return sa.URL.create("sqlite", database=text)
    try:
        url = sa.make_url(text)
    except sa.exc.ArgumentError as e:
        raise ValueError(f"store {redacted(text)!r} is not a URL ({e})") from None
    if url.drivername in ("postgresql", "postgres", "postgresql+psycopg"):
        return url.set(drivername="postgresql+psycopg")
    if url.drivername == "sqlite" and url.database:
        return url
    raise ValueError(f"store {redacted(text)!r}: llmgw keeps its state in SQLite (a path, or "
                     "sqlite:///PATH) or PostgreSQL (postgresql://USER@HOST:PORT/DB)")


def redacted(where: str | sa.URL) -> str:
    """A store's location as it may be shown: shown_url's, read as SQLAlchemy reads it (a
    password with an unescaped `/` is still a password), so no user and no password."""
    if isinstance(where, sa.URL):
        return shown_url(where.render_as_string(hide_password=True))
    if "://" not in where:
        return where
    try:
        return shown_url(sa.make_url(where).render_as_string(hide_password=True))
    except sa.exc.ArgumentError:
        return "(a URL that does not parse)"


def refusal(e: BaseException, where: str | sa.URL) -> str:
    """Why the store at where refused to be opened or used, in one line (the driver's
    reason, without SQLAlchemy's statement and link), and what to do about it."""
    found = getattr(e, "orig", None) or e
    line = (str(found).strip().splitlines() or [type(found).__name__])[0]
    # psycopg: "connection failed: connection to server at "H", port P failed: FATAL:  WHY";
    # the URL shown already names the host and port.
    reason = line.rsplit("failed: ", 1)[-1].removeprefix("FATAL:").strip() \
        if line.startswith("connection failed: ") else line
    shown = redacted(where)
    sqlite = "://" not in shown or shown.startswith("sqlite")
    remedy = "check that this user may write the file and its folder" if sqlite \
        else _remedy(reason)
    return f"the store {shown} refused: {reason}; {remedy}"


def _remedy(reason: str) -> str:
    """What to do about a PostgreSQL server's refusal (libpq's words for it)."""
    if "password" in reason:
        return "check the user and password in the URL (or PGPASSWORD, ~/.pgpass)"
    if reason.startswith("database ") and reason.endswith("does not exist"):
        return ("create it first on the database server (`createdb -O USER DB`), or check "
                "the database name in the URL")
    if reason.startswith("role ") and reason.endswith("does not exist"):
        return "check the user in the URL, or create that role on the database server"
    if any(w in reason for w in ("refused", "timeout", "resolve", "unreachable", "No route")):
        return "is PostgreSQL running there, and are the URL's host and port right?"
    return "check the URL, and that its user owns the database (docs/operations.md)"


def answers(where: str | Path, *, timeout_s: float = 5.0) -> str:
    """'' when the store at where accepts a connection and a query now, else refusal()'s
    line. A SQLite file is this machine's and made when first opened: always ''."""
    url = store_url(where)
    if url.get_backend_name() == "sqlite":
        return ""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool,
                              connect_args={"connect_timeout": max(1, round(timeout_s))})
    try:
        with engine.connect() as conn:
            conn.execute(sa.select(sa.literal(1)))
    except SQLAlchemyError as e:
        return refusal(e, str(where))
    finally:
        engine.dispose()
    return ""


class Database:
    """The store's connections; migrate=False (the gateway) reads a schema the control
    plane made, and refuses one of another revision, saying which."""

    def __init__(self, where: str | Path, *, busy_timeout_s: float = 5.0,
                 migrate: bool = True) -> None:
        self.url = store_url(where)
        self.backend = self.url.get_backend_name()
        self.where = (self.url.database or "") if self.backend == "sqlite" \
            else redacted(self.url)
        if self.backend == "sqlite":
            self._writer, self._reader = self._sqlite_engines(busy_timeout_s)
        else:
            engine = sa.create_engine(
                self.url, pool_pre_ping=True, pool_size=4, max_overflow=12,
                connect_args={
                    "connect_timeout": max(1, round(busy_timeout_s)),
                    # A server cut off mid-query (a split) is given up on in seconds, not
                    # after TCP's minutes; no statement of ours runs longer than this.
                    "tcp_user_timeout": 5000, "keepalives": 1, "keepalives_idle": 5,
                    "keepalives_interval": 2, "keepalives_count": 2,
                    "options": "-c statement_timeout=10000"})
            self._writer = engine
            self._reader = engine.execution_options(isolation_level="AUTOCOMMIT")
        self._lock = threading.RLock()
        # Write statements this process ran, by table: a reader that keeps a table in
        # memory (the heartbeat's replicas) knows when its copy fell behind its own writes.
        self.writes: dict[str, int] = {}
        self._written: set[str] = set()  # tables the transaction under way wrote
        sa.event.listen(self._writer, "before_execute", self._count_write)
        # Since when (monotonic) the database server could not be reached, and whom to tell
        # when it can again (the store resets its hearing: nodes could not beat meanwhile).
        self.unreachable_since: float | None = None
        self.on_reachable: Callable[[float], None] | None = None
        # A store that cannot be opened is an error for the caller to say (no process goes
        # on without its store): only a store once opened is tried again, and says so.
        self._opened = False
        try:
            with _ours():
                if migrate:
                    self._migrate()
                else:
                    self._check_revision()
        except BaseException:
            self.close()
            raise
        self._opened = True

    def _count_write(self, conn: Connection, statement: Any, *args: Any) -> None:
        if getattr(statement, "is_dml", False):
            name = statement.table.name
            self.writes[name] = self.writes.get(name, 0) + 1
            self._written.add(name)

    def _sqlite_engines(self, busy_timeout_s: float) -> tuple[sa.Engine, sa.Engine]:
        assert self.url.database
        Path(self.url.database).parent.mkdir(parents=True, exist_ok=True)
        writer = sa.create_engine(self.url, poolclass=sa.pool.StaticPool,
                                  connect_args={"check_same_thread": False, "timeout": 5.0})
        # A read opens the file anew (a fraction of a millisecond): a pooled connection
        # would go on reading a file replaced under it (a restore) as if nothing happened.
        reader = sa.create_engine(
            self.url, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT",
            connect_args={"check_same_thread": False, "timeout": busy_timeout_s})

        @sa.event.listens_for(writer, "connect")
        def _tune(dbapi: Any, record: Any) -> None:
            dbapi.isolation_level = None  # transactions are ours (below), not the driver's
            dbapi.execute("PRAGMA journal_mode=WAL")
            # In WAL, NORMAL syncs at checkpoints, not on every commit: a heartbeat lost to a
            # power cut is sent again 5 s later, and an fsync per beat caps the node count.
            dbapi.execute("PRAGMA synchronous=NORMAL")
            # A checkpoint copies the log into the database and syncs it: done inside a
            # commit it stalls the heartbeat that happened to cross the threshold, so
            # `checkpoint()` runs it on the scheduler's thread instead.
            dbapi.execute("PRAGMA wal_autocheckpoint=0")

        @sa.event.listens_for(writer, "begin")
        def _begin(conn: Connection) -> None:
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return writer, reader

    @contextmanager
    def _watched(self) -> Iterator[None]:
        """Notes when a PostgreSQL server stops and starts answering (SQLite's errors are
        this machine's: a lock, a full disk)."""
        try:
            yield
        except (sa.exc.OperationalError, sa.exc.InterfaceError) as e:
            if self.backend == "postgresql" and self.unreachable_since is None \
                    and self._opened:
                self.unreachable_since = time.monotonic()
                log.warning("the store %s cannot be reached (%s); going on from memory "
                            "where possible and trying again", self.where,
                            str(e.orig or e).strip().splitlines()[0])
            raise
        else:
            if self.unreachable_since is not None:
                down_s = time.monotonic() - self.unreachable_since
                self.unreachable_since = None
                log.info("the store %s answers again, after %.1f s", self.where, down_s)
                if self.on_reachable:
                    try:
                        self.on_reachable(down_s)
                    except StoreError as e:  # away again: the next answer tells it again
                        self.unreachable_since = time.monotonic()
                        log.warning("the store %s went away again: %s", self.where, e)

    @contextmanager
    def tx(self) -> Iterator[Connection]:
        """One write transaction, committed when the block ends, rolled back on an error
        (StoreError, or StoreConflict where a unique key refused it)."""
        with _ours(), self._watched(), self._lock:
            try:
                with self._writer.begin() as conn:
                    yield conn
            finally:
                # Counted again once committed (or rolled back): a reader in another thread
                # that re-read between the statement and its commit, and kept that copy
                # under the count then, reads again (store.nodes' replica cache).
                written, self._written = self._written, set()
                for name in written:
                    self.writes[name] = self.writes.get(name, 0) + 1

    def read(self, statement: sa.Executable) -> Sequence[RowMapping]:
        """One statement outside any transaction: a snapshot, no write lock."""
        with _ours(), self._watched(), self._reader.connect() as conn:
            return conn.execute(statement).mappings().all()

    def read_rows(self, statement: sa.Executable) -> Sequence[tuple[Any, ...]]:
        """read()'s rows as plain tuples, in the statement's column order: for thousands
        of rows, where a mapping's lookups by name cost more than the query."""
        with _ours(), self._watched(), self._reader.connect() as conn:
            return conn.execute(statement).all()

    @contextmanager
    def snapshot(self) -> Iterator[Connection]:
        """A read-only view of the whole store at one moment, for as long as the block
        runs (a backup, a move to another backend): SQLite's deferred transaction holds its
        WAL snapshot; PostgreSQL's REPEATABLE READ holds one too. Writers go on beside it."""
        with _ours(), self._snapshot() as conn:
            yield conn

    @contextmanager
    def _snapshot(self) -> Iterator[Connection]:
        if self.backend == "sqlite":
            with self._reader.connect() as conn:
                conn.exec_driver_sql("BEGIN")
                try:
                    yield conn
                finally:
                    conn.exec_driver_sql("ROLLBACK")
        else:
            with self._writer.connect().execution_options(
                    isolation_level="REPEATABLE READ", postgresql_readonly=True) as conn:
                with conn.begin():
                    yield conn

    def checkpoint(self) -> None:
        """Copy SQLite's write-ahead log into the database, beside the writer (PASSIVE);
        nothing for PostgreSQL."""
        if self.backend == "sqlite":
            with _ours(), self._reader.connect() as conn:
                conn.exec_driver_sql("PRAGMA wal_checkpoint(PASSIVE)")

    def close(self) -> None:
        with self._lock:
            self._reader.dispose()
            self._writer.dispose()

    # --- the schema ---

    def revision(self) -> str | None:
        """The store's schema revision; None for a store without one (new or pre-migration)."""
        with _ours(), self._reader.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()

    def _migrate(self) -> None:
        config = _alembic_config()
        known = _known_revisions(config)
        with self.tx() as conn:
            if self.backend == "postgresql":
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": _MIGRATION_LOCK})
            current = MigrationContext.configure(conn).get_current_revision()
            if current is not None and current not in known:
                raise self._too_new(current, config)
            config.attributes["connection"] = conn
            if current is None and sa.inspect(conn).has_table("nodes"):
                _complete_legacy_columns(conn)
                log.info("store %s: made before schema revisions; stamped at the baseline",
                         self.where)
            command.upgrade(config, "head")
            now = MigrationContext.configure(conn).get_current_revision()
        if now != current:
            log.info("store %s: schema at revision %s (was %s)", self.where, now,
                     current or "none")

    def _check_revision(self) -> None:
        config = _alembic_config()
        head = ScriptDirectory.from_config(config).get_current_head()
        current = self.revision()
        if current == head:
            return
        if current is None:
            raise SchemaError(
                f"the store {self.where} has no llmgw schema yet: the control plane makes it "
                "when it starts; start llmgw-server (`llmgw server`) first, then this")
        if current not in _known_revisions(config):
            raise self._too_new(current, config)
        raise SchemaError(
            f"the store {self.where} is at schema revision {current}, older than this "
            f"llmgw's {head}: the control plane migrates it when it starts; restart "
            "llmgw-server with this same llmgw, then this")

    def _too_new(self, current: str, config: Config) -> SchemaError:
        head = ScriptDirectory.from_config(config).get_current_head()
        return SchemaError(
            f"the store {self.where} is at schema revision {current}, which this llmgw "
            f"(newest revision {head}) does not know: a newer llmgw migrated it, and this "
            "code could misread it; run that newer llmgw, or restore a backup made before "
            "the upgrade (`llmgw restore`)")


def _alembic_config() -> Config:
    config = Config()
    config.set_main_option("script_location", _MIGRATIONS)
    return config


def _known_revisions(config: Config) -> set[str]:
    return {s.revision for s in ScriptDirectory.from_config(config).walk_revisions()}


def _complete_legacy_columns(conn: Connection) -> None:
    """Add the columns a store made by an early release lacks, so it is the baseline."""
    inspector = sa.inspect(conn)
    for table, columns in _LEGACY_COLUMNS.items():
        have = {c["name"] for c in inspector.get_columns(table)}
        for column, kind in columns.items():
            if column not in have:
                conn.exec_driver_sql(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")




def insert(conn: Connection, table: sa.Table) -> Any:
    """INSERT for conn's backend, with its `on_conflict_do_update` (both dialects spell it
    alike: `excluded` is the row that was refused)."""
    from sqlalchemy.dialects import postgresql, sqlite

    if conn.dialect.name == "postgresql":
        return postgresql.insert(table)
    return sqlite.insert(table)


class Aggregate:
    """What each aggregate of the store (nodes, tokens, catalog, replicas, keys) works on:
    the database and the clock its rows are stamped with."""

    db: Database
    clock: Any
