"""llmgw.cli.control_plane_join: the fleet's shared secrets sealed with a certificate key the
store never sees, handed out once for a control-plane token over the agent API (a real
one, TLS with a CA made now), and opened only with that key."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw import config
from llmgw.agent.join import JoinError
from llmgw.cli import control_plane_join
from llmgw.host import pki
from llmgw.host.layout import Layout


def _fleet(root: Path) -> tuple[Layout, config.ServerConfig]:
    layout = Layout.for_mode("local", root)
    layout.pki.mkdir(parents=True)
    pki.create_ca().write(layout.pki, "ca")
    layout.admin_token.write_text("admin-secret\n")
    server = config.ServerConfig(state_dir=str(layout.server_state),
                                 store="postgresql://llmgw@db:5432/llmgw", gateway_keys="required")
    return layout, server


def test_a_bundle_opens_only_with_its_key_and_carries_the_shared_settings(tmp_path) -> None:
    layout, server = _fleet(tmp_path / "a")
    key = control_plane_join.new_certificate_key()
    sealed = control_plane_join.seal(layout, server, key)
    assert "admin-secret" not in sealed and "BEGIN" not in sealed
    bundle = control_plane_join.unseal(sealed, key)
    assert bundle.files["ca-key.pem"] == layout.ca_key.read_bytes()
    assert bundle.server["store"] == "postgresql://llmgw@db:5432/llmgw"
    assert "admin_listen" not in bundle.server, "each machine's own listeners stay its own"
    with pytest.raises(control_plane_join.ControlPlaneJoinError, match="does not open"):
        control_plane_join.unseal(sealed, control_plane_join.new_certificate_key())
    with pytest.raises(control_plane_join.ControlPlaneJoinError, match="64 hex digits"):
        control_plane_join.unseal(sealed, "not-a-key")
    new = Layout.for_mode("local", tmp_path / "b")
    control_plane_join.write(bundle, new)
    assert new.ca_key.stat().st_mode & 0o777 == 0o600
    assert control_plane_join.settings(new)["gateway_keys"] == "required"


def test_a_fleet_on_its_own_sqlite_is_refused_a_second_control_plane(tmp_path) -> None:
    _, server = _fleet(tmp_path / "a")
    control_plane_join.shareable(server)  # the control: a shared store is accepted
    with pytest.raises(control_plane_join.ControlPlaneJoinError, match="move it to PostgreSQL"):
        control_plane_join.shareable(server.model_copy(update={"store": ""}))


def test_the_agent_api_hands_a_control_plane_token_its_bundle_once(live_control_plane) -> None:
    from llmgw.control.agent_api import token_hash

    cp = live_control_plane
    url = f"https://127.0.0.1:{cp.agent_port}"
    cp.store.add_token(token_hash("cp.token"), 600, bundle="c2VhbGVk")
    cp.store.add_token(token_hash("node.token"), 600)
    with pytest.raises(JoinError, match="not for a control plane"):
        control_plane_join.fetch(url, "node.token", cp.ca_hash, "cp2")
    assert control_plane_join.fetch(url, "cp.token", cp.ca_hash, "cp2") == "c2VhbGVk"
    with pytest.raises(JoinError, match="used by cp2"):
        control_plane_join.fetch(url, "cp.token", cp.ca_hash, "cp3")
    with pytest.raises(JoinError, match="this is not the control plane"):
        control_plane_join.fetch(url, "cp.token", "sha256:" + "0" * 64, "cp3")


def test_a_certificate_key_cut_short_is_refused_before_the_token_is_spent(
        live_control_plane, postgres_url, tmp_path) -> None:
    """The key's shape is checked before the bundle is fetched: a key one character short
    writes nothing and leaves the token for the run with the whole line (the control; the
    fleet's store answers, as a join checks before it spends the token)."""
    from llmgw.control.agent_api import token_hash
    from llmgw_harness import pki as pki_step
    from llmgw_harness._changes import apply_fix
    from llmgw_harness._host import Host
    from llmgw_harness._promise import CannotFix
    from llmgw_harness._report import Recorder
    from llmgw_harness.settings import HostSettings, Join

    cp = live_control_plane
    layout, server = _fleet(tmp_path / "a")
    key = control_plane_join.new_certificate_key()
    server = server.model_copy(update={"store": postgres_url})
    cp.store.add_token(token_hash("cp.token"), 600,
                       bundle=control_plane_join.seal(layout, server, key))
    url = f"https://127.0.0.1:{cp.agent_port}"

    def joining(certificate_key: str) -> Host:
        settings = HostSettings(layout=Layout.for_mode("local", tmp_path / "b"),
                                join=Join(url, "cp.token", cp.ca_hash, True, certificate_key))
        return Host(settings, Recorder(), apply=True)

    short = joining(key[:-1])
    with pytest.raises(CannotFix, match="has 63 characters, where 64 hex digits belong"):
        apply_fix(pki_step.ca.fixer, short, pki_step.ca(short))
    assert not short.layout.ca_cert.exists() and not short.layout.admin_token.exists()
    whole = joining(key)
    apply_fix(pki_step.ca.fixer, whole, pki_step.ca(whole))
    assert whole.layout.ca_key.read_bytes() == layout.ca_key.read_bytes(), "the token was kept"


def test_a_join_whose_fleet_store_does_not_answer_leaves_its_token_unspent(
        live_control_plane, postgres_server, tmp_path) -> None:
    """The bundle names the fleet's PostgreSQL database, which does not answer from here
    (dropped for now): the join refuses before it spends the token, saying so, and writes
    nothing. The control: once the database is back, the same line joins, and only then is
    the token spent."""
    import psycopg

    from llmgw.control.agent_api import token_hash
    from llmgw_harness import pki as pki_step
    from llmgw_harness._changes import apply_fix
    from llmgw_harness._host import Host
    from llmgw_harness._promise import CannotFix
    from llmgw_harness._report import Recorder
    from llmgw_harness.settings import HostSettings, Join

    cp = live_control_plane
    store_url = postgres_server.create_database()
    database = store_url.rsplit("/", 1)[1]

    def admin(sql: str) -> None:
        with psycopg.connect(postgres_server.url(), autocommit=True) as conn:
            conn.execute(sql)

    layout, server = _fleet(tmp_path / "a")
    key = control_plane_join.new_certificate_key()
    cp.store.add_token(token_hash("cp.token"), 600, bundle=control_plane_join.seal(
        layout, server.model_copy(update={"store": store_url}), key))
    url = f"https://127.0.0.1:{cp.agent_port}"
    settings = HostSettings(layout=Layout.for_mode("local", tmp_path / "b"),
                            join=Join(url, "cp.token", cp.ca_hash, True, key))
    admin(f'DROP DATABASE "{database}"')
    joining = Host(settings, Recorder(), apply=True)
    with pytest.raises(CannotFix, match="the fleet's store does not answer from this machine: "
                                        ".*the join token is not spent"):
        apply_fix(pki_step.ca.fixer, joining, pki_step.ca(joining))
    assert not joining.layout.ca_cert.exists() and not joining.layout.admin_token.exists()
    assert cp.store.use_control_plane_token(token_hash("cp.token"), "look", spend=False)[0] \
        == "ok", "the token is unspent"

    admin(f'CREATE DATABASE "{database}"')
    again = Host(settings, Recorder(), apply=True)
    apply_fix(pki_step.ca.fixer, again, pki_step.ca(again))
    assert again.layout.ca_key.read_bytes() == layout.ca_key.read_bytes()
    assert control_plane_join.settings(again.layout)["store"] == store_url
    with pytest.raises(JoinError, match="used by"):
        control_plane_join.fetch(url, "cp.token", cp.ca_hash, "cp3", spend=False)
