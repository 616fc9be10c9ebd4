"""`llmgw token create` as a person runs it: the join line from a live admin API, and the
documented exit status 3 where there is no control plane to ask."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw import cli, config
from llmgw.control.admin_api import make_admin_app
from llmgw.host import admin_token, pki
from llmgw.host.layout import Layout
from llmgw.store import Store
from tests.servers import serve_asgi


def _state(root: Path) -> list[str]:
    return ["--state-dir", str(root), "--mode", "local"]


def _control_plane_files(root: Path, admin_listen: str) -> Layout:
    """A control plane's CA, server certificate, admin token and server.yaml."""
    layout = Layout.for_mode("local", root)
    layout.pki.mkdir(parents=True)
    ca = pki.create_ca()
    ca.write(layout.pki, "ca")
    pki.issue_server(ca, ["127.0.0.1"]).write(layout.pki, "server")
    admin_token.ensure(layout.admin_token)
    server = config.ServerConfig(
        admin_listen=admin_listen, state_dir=str(layout.server_state),
        tls=config.TLSFiles(ca=str(layout.ca_cert), cert=str(layout.server_cert),
                            key=str(layout.server_key)))
    layout.server_yaml.write_text(config.render(server, "# server.yaml\n"))
    return layout


def test_token_create_without_a_control_plane_exits_3(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = Store(tmp_path / "control.db")
    root = tmp_path / "state"
    hash_path = root / "etc" / admin_token.HASH_FILE
    with serve_asgi(make_admin_app(store, node_timeout_s=30.0, token_hash=hash_path)) as url:
        _control_plane_files(root, url.removeprefix("http://"))
        assert cli.main(["token", "create", *_state(root)]) == 0, "control: one answers"
        assert "pytest provision/ --join https://" in capsys.readouterr().out
    # Stopped: nothing answers at server.yaml's address.
    assert cli.main(["token", "create", *_state(root)]) == 3
    assert "is the control plane running?" in capsys.readouterr().err
    # No server.yaml at all.
    assert cli.main(["token", "create", *_state(tmp_path / "none")]) == 3
    assert "no control plane here" in capsys.readouterr().err
    store.close()
