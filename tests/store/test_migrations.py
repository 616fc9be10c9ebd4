"""Schema revisions: a new store is made at the newest, a store from before revisions is
stamped at the baseline (its rows kept), a newer store is refused, and only the control
plane migrates."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from llmgw.store import SchemaError, Store
from llmgw.store._db import _alembic_config
from llmgw.store._schema import metadata

# The newest revision: what a store opened by this code is at.
HEAD = ScriptDirectory.from_config(_alembic_config()).get_current_head()


def test_the_newest_revision_makes_the_schema_the_code_reads(store_at: str) -> None:
    """_schema.py and the migrations agree, on both backends: nothing for autogenerate to
    add. (Its control: a table the code has and the migrations lack is found.)"""
    Store(store_at).close()
    engine = sa.create_engine(Store(store_at).db.url)
    with engine.connect() as conn:
        context = MigrationContext.configure(conn)
        assert compare_metadata(context, metadata) == []
        extra = sa.MetaData()
        for table in metadata.tables.values():
            table.to_metadata(extra)
        sa.Table("elections", extra, sa.Column("id", sa.Text, primary_key=True))
        assert [d[0] for d in compare_metadata(context, extra)] == ["add_table"]
    engine.dispose()


def test_opening_twice_migrates_once_and_keeps_the_rows(store_at: str) -> None:
    first = Store(store_at)
    first.record_heartbeat("n1", {})
    assert first.db.revision() == HEAD
    first.close()
    again = Store(store_at)
    assert [n["id"] for n in again.nodes()] == ["n1"]
    again.close()


def _old_database(path: Path, inventory: str) -> None:
    """Rows as a release before revisions wrote them: no inv_version, serial or gpus, no
    tokens or keys table."""
    db = sqlite3.connect(path)
    db.executescript(
        "CREATE TABLE nodes (id TEXT PRIMARY KEY, inventory TEXT NOT NULL, "
        "first_seen REAL NOT NULL, last_seen REAL NOT NULL);"
        "CREATE TABLE replicas (id TEXT PRIMARY KEY, model TEXT NOT NULL, node TEXT NOT NULL, "
        "profile TEXT NOT NULL, state TEXT NOT NULL, err TEXT NOT NULL DEFAULT '', "
        "endpoint TEXT NOT NULL DEFAULT '', api_key TEXT NOT NULL DEFAULT '', "
        "updated REAL NOT NULL);"
        "CREATE TABLE models (name TEXT PRIMARY KEY, spec TEXT NOT NULL, created REAL NOT NULL);")
    db.execute("INSERT INTO nodes VALUES ('n1', ?, 1, 2)", (inventory,))
    db.execute("INSERT INTO replicas VALUES ('r1', 'm', 'n1', 'cpu', 'ready', '', "
               "'http://127.0.0.1:9', 'k', 3)")
    db.commit()
    db.close()


def test_a_store_from_before_revisions_is_stamped_at_the_baseline_with_its_rows(
        tmp_path: Path) -> None:
    inventory = {"node_id": "n1", "claimed_id": "n1", "cpus": 2, "memory_mb": 2048,
                 "gpus": [{"index": 0, "name": "NVIDIA H100", "memory_mb": 81559,
                           "uuid": "GPU-1", "class": "h100-80gb"}],
                 "labels": {"zone": "a"}, "engines": ["llamacpp"],
                 "provision": [{"engine": "llamacpp", "version": "0.3.36", "state": "ready",
                                "detail": ""}],
                 "interface": "lo", "addr": "127.0.0.1", "warnings": [],
                 "replica_state_changes": {"r1": {"model": "m", "to": {"ready": 1}}},
                 "replica_logs": {"r1": ["line"]}}
    _old_database(tmp_path / "db", json.dumps(inventory))
    with pytest.raises(SchemaError, match="no llmgw schema yet"):
        Store(tmp_path / "db", migrate=False)  # the gateway never stamps or migrates
    store = Store(tmp_path / "db")
    assert store.db.revision() == HEAD, "stamped at the baseline, then migrated on"
    assert store.node("n1") == {"id": "n1", "inventory": inventory, "first_seen": 1,
                                "last_seen": 2, "serial": ""}
    assert store.replicas() == [{"id": "r1", "model": "m", "node": "n1", "profile": "cpu",
                                 "state": "ready", "err": "", "endpoint": "http://127.0.0.1:9",
                                 "api_key": "k", "gpus": [], "updated": 3}]
    store.add_token("h", 60)  # the tables it lacked were made
    assert store.add_key({"id": "k1", "name": "a", "prefix": "p", "hash": "h"}) == ""
    store.close()


def test_an_old_invalid_inventory_is_shown_as_a_warning_not_a_crash(tmp_path: Path) -> None:
    """One bad row stored before inventories were checked never stops the readers."""
    _old_database(tmp_path / "db", json.dumps({"cpus": "many"}))
    store = Store(tmp_path / "db")
    (warning,) = store.node("n1")["inventory"]["warnings"]
    assert "cpus" in warning and "next heartbeat replaces it" in warning
    store.record_heartbeat("n1", {"cpus": 2})
    assert store.node("n1")["inventory"] == {"cpus": 2}
    store.close()


def test_a_model_stored_before_a_field_existed_is_read_with_the_catalogs_defaults(
        tmp_path: Path) -> None:
    """Readers never hedge (`.get("routing_profile", "chat")`): the store fills in what an
    older row lacks, as the catalog would have."""
    store = Store(tmp_path / "db")
    old = {"name": "m", "source": "http://mirror/m.gguf", "scaling": {"min": 1, "max": 1},
           "profiles": [{"name": "cpu", "engine": "llamacpp", "gpu_class": "",
                         "priority": 100, "min_memory_gb": 0, "node_selector": {},
                         "args": []}]}
    with sqlite3.connect(tmp_path / "db") as db:
        db.execute("INSERT INTO models (name, spec, created) VALUES (?, ?, 0)",
                   ("m", json.dumps(old)))
        (raw,) = db.execute("SELECT spec FROM models").fetchone()
    assert "routing_profile" not in json.loads(raw), "negative control: the row lacks it"
    (model,) = store.models()
    assert (model["routing_profile"], model["sha256"], model["size_bytes"]) == ("chat", "", 0)
    assert model["aliases"] == [] and model["geometry"]["context_length"] == 0
    store.close()


def test_a_store_a_newer_llmgw_migrated_is_refused_saying_what_to_do(store_at: str) -> None:
    Store(store_at).close()
    engine = sa.create_engine(Store(store_at, migrate=False).db.url)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE alembic_version SET version_num = '0099'"))
    engine.dispose()
    for migrate in (True, False):
        with pytest.raises(SchemaError, match="revision 0099, which this llmgw .* does not "
                                              "know: a newer llmgw migrated it"):
            Store(store_at, migrate=migrate)


def test_the_gateway_refuses_an_older_schema_and_names_who_migrates(store_at: str) -> None:
    Store(store_at).close()
    assert Store(store_at, migrate=False).nodes() == [], "control: this revision is read"
    engine = sa.create_engine(Store(store_at, migrate=False).db.url)
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM alembic_version"))
    engine.dispose()
    with pytest.raises(SchemaError, match="has no llmgw schema yet: the control plane makes "
                                          "it when it starts"):
        Store(store_at, migrate=False)


def test_revision_0002_adds_the_control_plane_tables_to_a_baseline_store(
        store_at: str) -> None:
    """Revision 0002 adds control_planes and leases to a store at 0001, its rows kept, and
    the store opens on to the newest. (Its control: at 0001 the tables are not there.)"""
    from alembic import command

    from llmgw.store import store_url

    engine = sa.create_engine(store_url(store_at))
    config = _alembic_config()
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.upgrade(config, "0001")
        conn.execute(sa.text("INSERT INTO nodes (id, inventory, first_seen, last_seen) "
                             "VALUES ('n1', '{}', 1, 2)"))
        assert not sa.inspect(conn).has_table("leases")
        command.upgrade(config, "0002")
        assert {"leases", "control_planes"} <= set(sa.inspect(conn).get_table_names())
    engine.dispose()
    again = Store(store_at)
    assert again.db.revision() == HEAD
    assert [n["id"] for n in again.nodes()] == ["n1"]
    assert again.acquire_lease("cp-a", 10) is not None and again.control_planes() == []
    again.close()


# The revision that adds the sessions table and viewer keys' expiry, and the one before
# (renumbered with the file, should revisions merge).
SESSIONS_REVISION, BEFORE_SESSIONS = "0005", "0004"


def test_the_sessions_revision_adds_sessions_and_viewer_expiry_keeping_viewer_keys(
        store_at: str) -> None:
    """The sessions revision adds the sessions table and viewers.expires to a store at the
    revision before, its viewer keys kept (expiring never). (Its control: before it, neither
    is there.)"""
    from alembic import command

    from llmgw.store import store_url

    engine = sa.create_engine(store_url(store_at))
    config = _alembic_config()
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.upgrade(config, BEFORE_SESSIONS)
        conn.execute(sa.text("INSERT INTO viewers (id, name, prefix, hash, created) "
                             "VALUES ('v1', 'ops', 'vk-llmgw-v1', 'h1', 1)"))
        assert not sa.inspect(conn).has_table("sessions")
        assert "expires" not in {c["name"] for c in sa.inspect(conn).get_columns("viewers")}
        command.upgrade(config, SESSIONS_REVISION)
        assert sa.inspect(conn).has_table("sessions")
    engine.dispose()
    again = Store(store_at)
    viewer = again.viewer_by_hash("h1")
    assert viewer is not None and viewer["name"] == "ops" and viewer["expires"] is None
    assert again.add_session({"hash": "s", "role": "viewer", "name": "ops", "credential": "h1",
                              "expires": 2e9}, per_credential=1, total=1) == []
    again.close()
