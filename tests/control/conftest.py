"""A real control plane in-process: its store, admin app and mTLS agent API on free ports."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from llmgw.control.admin_api import make_admin_app
from llmgw.control.agent_api import AgentAPI, AgentAPIServer, mtls_context
from llmgw.host import admin_token, pki
from llmgw.store import Store


@dataclass
class ControlPlane:
    store: Store
    admin: TestClient
    agent_port: int
    ca: pki.KeyPair
    pki_dir: Path
    # The admin token the admin client sends; anonymous() is a client without it.
    token: str
    app: object
    server: AgentAPIServer

    def anonymous(self) -> TestClient:
        return TestClient(self.app)

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.agent_port}"

    @property
    def ca_hash(self) -> str:
        return pki.ca_hash(self.ca.cert)

    def client_cert(self, cn: str, ca: pki.KeyPair | None = None) -> tuple[str, str]:
        """Write a client certificate for cn (from ca, the cluster CA by default)."""
        stem = f"client-{cn}-{id(ca)}"
        cert, key = pki.issue_client(ca or self.ca, cn).write(self.pki_dir, stem)
        return str(cert), str(key)


@pytest.fixture
def live_control_plane(tmp_path: Path) -> Iterator[ControlPlane]:
    """Function: a control plane on a temp SQLite db; admin app via TestClient (sending the
    admin token), agent API live (with the CA key: it admits joins and refuses removed nodes
    at the handshake)."""
    ca = pki.create_ca()
    ca.write(tmp_path, "ca")
    pki.issue_server(ca, ["127.0.0.1", "localhost"]).write(tmp_path, "server")
    store = Store(tmp_path / "control.db")
    tls = (str(tmp_path / "ca.pem"), str(tmp_path / "server.pem"),
           str(tmp_path / "server-key.pem"))
    agent_api = AgentAPIServer("127.0.0.1", 0, mtls_context(*tls), AgentAPI(store, ca), tls=tls)
    agent_api.start()
    token_path = tmp_path / "etc" / admin_token.TOKEN_FILE
    admin_token.ensure(token_path)
    token = admin_token.read_token(token_path)
    app = make_admin_app(store, node_timeout_s=30.0,
                         token_hash=admin_token.hash_path_for(token_path),
                         on_node_removed=agent_api.revoke, drift=agent_api.api.drift)
    admin = TestClient(app, headers={"Authorization": f"Bearer {token}"})
    try:
        yield ControlPlane(store, admin, agent_api.port, ca, tmp_path, token, app, agent_api)
    finally:
        agent_api.stop()
        store.close()
