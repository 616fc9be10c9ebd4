"""Joining: a single-use token, a CA pinned by hash, a CSR signed with CN = the node id."""

from __future__ import annotations

import ssl
from pathlib import Path

import httpx
import pytest

from llmgw.agent.client import AgentClient
from llmgw.agent.join import JoinError, join
from llmgw.config import TLSFiles
from llmgw.contract import AgentPaths
from llmgw.host import pki


def _token(cp, ttl_s: float = 600) -> str:
    r = cp.admin.post("/api/v1/tokens", json={"ttl_s": ttl_s})
    assert r.status_code == 201, r.text
    return r.json()["token"]


def _join(cp, tmp_path: Path, token: str, node_id: str = "n2", ca_hash: str | None = None):
    d = tmp_path / node_id
    d.mkdir(exist_ok=True)
    return join(cp.url, token, ca_hash or cp.ca_hash, node_id,
                d / "agent-key.pem", d / "agent.pem", d / "ca.pem")


def test_join_signs_the_node_id_for_a_key_made_here(live_control_plane, tmp_path) -> None:
    cp = live_control_plane
    joined = _join(cp, tmp_path, _token(cp))
    d = tmp_path / "n2"
    cert, key = pki.load_cert(d / "agent.pem"), pki.load_key(d / "agent-key.pem")
    assert pki.common_name(cert) == "n2" and pki.key_matches(cert, key)
    assert pki.chains_to(cert, cp.ca.cert) and pki.has_client_auth(cert)
    assert (d / "agent-key.pem").stat().st_mode & 0o777 == 0o600
    assert joined.ca_path.read_bytes() == (cp.pki_dir / "ca.pem").read_bytes()
    # The joined identity works over mTLS, and the node reads its own record.
    client = AgentClient(cp.url, TLSFiles(ca=str(d / "ca.pem"), cert=str(d / "agent.pem"),
                                          key=str(d / "agent-key.pem")))
    assert client.heartbeat({"engines": ["llamacpp"]})["node_id"] == "n2"
    me = client.node()
    client.close()
    assert me["id"] == "n2" and me["state"] == "ready" and me["engines"] == ["llamacpp"]


def test_the_token_is_stored_hashed(live_control_plane) -> None:
    cp = live_control_plane
    token = _token(cp)
    db = b"".join(p.read_bytes() for p in cp.pki_dir.glob("control.db*"))
    assert db
    assert token.encode() not in db and token.split(".")[1].encode() not in db


def test_the_same_token_again_is_refused(live_control_plane, tmp_path) -> None:
    cp = live_control_plane
    token = _token(cp)
    _join(cp, tmp_path, token, "n2")
    with pytest.raises(JoinError, match="used by n2.*llmgw token create"):
        _join(cp, tmp_path, token, "n3")
    assert not (tmp_path / "n3" / "agent-key.pem").exists()


def test_an_expired_token_is_refused(live_control_plane, tmp_path) -> None:
    cp = live_control_plane
    token = _token(cp, ttl_s=60)
    real = cp.store.clock
    cp.store.clock = lambda: real() + 61
    with pytest.raises(JoinError, match="expired"):
        _join(cp, tmp_path, token)


def test_an_unknown_token_is_refused(live_control_plane, tmp_path) -> None:
    with pytest.raises(JoinError, match="unknown"):
        _join(live_control_plane, tmp_path, "abcdef.0123456789abcdef0123456789abcdef")


def test_an_existing_node_id_is_refused(live_control_plane, tmp_path) -> None:
    cp = live_control_plane
    _join(cp, tmp_path, _token(cp), "n2")
    with pytest.raises(JoinError, match="n2 already exists.*--node-name.*llmgw node rm n2"):
        _join(cp, tmp_path, _token(cp), "n2")


def test_a_wrong_ca_hash_is_refused_naming_both(live_control_plane, tmp_path) -> None:
    cp = live_control_plane
    wrong = pki.ca_hash(pki.create_ca().cert)
    with pytest.raises(JoinError) as e:
        _join(cp, tmp_path, _token(cp), ca_hash=wrong)
    assert cp.ca_hash in str(e.value) and wrong in str(e.value)
    assert not (tmp_path / "n2" / "agent-key.pem").exists()


def test_ca_hash_is_sha256_of_the_spki_der(live_control_plane) -> None:
    """kubeadm's pin, so `openssl x509 -pubkey | openssl pkey -pubin -outform der |
    sha256sum` gives the same hex."""
    import hashlib

    from cryptography.hazmat.primitives import serialization

    cp = live_control_plane
    der = cp.ca.cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    assert cp.ca_hash == "sha256:" + hashlib.sha256(der).hexdigest()


def test_a_client_without_a_certificate_reaches_the_join_paths_only(live_control_plane) -> None:
    cp = live_control_plane
    ctx = ssl.create_default_context(cafile=str(cp.pki_dir / "ca.pem"))
    with httpx.Client(verify=ctx, timeout=5) as anon:
        beat = anon.post(f"{cp.url}{AgentPaths.HEARTBEAT}", json={"node_id": "sneaky"})
        refused_join = anon.post(f"{cp.url}{AgentPaths.JOIN}", json={})
    assert beat.status_code == 401 and "client certificate" in beat.json()["detail"]
    assert refused_join.status_code == 422
    assert cp.admin.get("/api/v1/nodes").json() == []


def test_the_csr_subject_does_not_choose_the_identity(live_control_plane) -> None:
    """The node asks for CN=admin; it gets the node id it joined as."""
    cp = live_control_plane
    key = pki.new_key()
    ctx = ssl.create_default_context(cafile=str(cp.pki_dir / "ca.pem"))
    body = {"token": _token(cp), "node_id": "n9", "csr": pki.make_csr(key, "admin").decode()}
    with httpx.Client(verify=ctx, timeout=5) as anon:
        r = anon.post(f"{cp.url}{AgentPaths.JOIN}", json=body)
    from cryptography import x509
    assert pki.common_name(x509.load_pem_x509_certificate(r.json()["cert"].encode())) == "n9"


def test_renewal_swaps_the_certificate_over_mtls(live_control_plane, tmp_path) -> None:
    cp = live_control_plane
    _join(cp, tmp_path, _token(cp), "n2")
    d = tmp_path / "n2"
    tls = TLSFiles(ca=str(d / "ca.pem"), cert=str(d / "agent.pem"), key=str(d / "agent-key.pem"))
    old = pki.load_cert(tls.cert)
    client = AgentClient(cp.url, tls)
    from llmgw.agent.join import renewal_request
    client.renew(*renewal_request("n2"))
    new = pki.load_cert(tls.cert)
    assert new.serial_number != old.serial_number and pki.common_name(new) == "n2"
    assert pki.key_matches(new, pki.load_key(tls.key))
    assert client.heartbeat({})["node_id"] == "n2"
    client.close()


def test_an_agent_renews_a_certificate_that_expires_soon(live_control_plane, tmp_path) -> None:
    from llmgw.agent.agent import Agent
    from llmgw.agent.engines.cpu import LlamaCpp
    from llmgw.agent.gpus import Discovery
    from llmgw.config import AgentConfig, EngineConfig

    cp = live_control_plane
    cert, key = pki.issue_client(cp.ca, "n5", days=10).write(tmp_path, "n5")
    tls = TLSFiles(ca=str(cp.pki_dir / "ca.pem"), cert=str(cert), key=str(key))
    agent = Agent(AgentConfig(server=cp.url, node_id="n5", state_dir=str(tmp_path), tls=tls),
                  engine=LlamaCpp(EngineConfig(cache_dir=str(tmp_path))),
                  discover=lambda: Discovery())
    agent.beat()  # registers
    agent.beat()  # a member now: looks at its certificate, renews it
    renewed = pki.load_cert(cert)
    assert not pki.expires_within(renewed, 30) and pki.common_name(renewed) == "n5"
    assert agent.client.heartbeat({})["node_id"] == "n5", "the new certificate is in use"
    agent.client.close()


def test_negative_control_a_certificate_far_from_expiry_is_kept(live_control_plane,
                                                                 tmp_path) -> None:
    from llmgw.agent.agent import Agent
    from llmgw.agent.engines.cpu import LlamaCpp
    from llmgw.agent.gpus import Discovery
    from llmgw.config import AgentConfig, EngineConfig

    cp = live_control_plane
    cert, key = pki.issue_client(cp.ca, "n6").write(tmp_path, "n6")
    before = pki.load_cert(cert).serial_number
    agent = Agent(AgentConfig(server=cp.url, node_id="n6", state_dir=str(tmp_path),
                              tls=TLSFiles(ca=str(cp.pki_dir / "ca.pem"), cert=str(cert),
                                           key=str(key))),
                  engine=LlamaCpp(EngineConfig(cache_dir=str(tmp_path))),
                  discover=lambda: Discovery())
    agent.beat()
    agent.beat()
    agent.client.close()
    assert pki.load_cert(cert).serial_number == before


def test_the_heartbeat_answer_names_the_mirror(tmp_path) -> None:
    """A node finds the mirror through the control plane, not a local server.yaml."""
    from llmgw.control.agent_api import AgentAPI
    from llmgw.store import Store

    store = Store(tmp_path / "db")
    answer = AgentAPI(store, mirror_url="http://10.0.0.1:8081").heartbeat("n1", {})
    store.close()
    assert answer["mirror"] == "http://10.0.0.1:8081"
