"""Joining a control plane (kubeadm's pattern) and renewing this node's certificate.

The node makes its key here and sends only a certificate request; the key never leaves
the machine. Before it trusts the control plane with anything, it pins the CA by the hash
the person copied from `llmgw token create`.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path

import httpx
from cryptography import x509

from llmgw import httpclient
from llmgw.contract import AgentPaths
from llmgw.errors import Error, shown_url
from llmgw.host import pki
from llmgw.host.files import atomic_write


class JoinError(Error):
    """The control plane could not be reached, is not the one pinned, or refused the join."""


@dataclass(frozen=True)
class Joined:
    node_id: str
    cert_path: Path
    ca_path: Path
    # The mirror's bytes URL as the control plane knows it ("" when it has none).
    mirror: str


def join(
    url: str, token: str, ca_hash: str, node_id: str,
    key_path: str | Path, cert_path: str | Path, ca_path: str | Path,
    *, timeout: float = httpclient.TIMEOUT_S, transport: httpx.BaseTransport | None = None,
) -> Joined:
    """Join the control plane at url (https://HOST:7443) as node_id; write the key (0600),
    the signed certificate and the pinned CA."""
    url = url.rstrip("/")
    ca_pem = pinned_ca(url, ca_hash, timeout)
    key = pki.new_key()
    body = {"token": token, "node_id": node_id, "csr": pki.make_csr(key, node_id).decode()}
    verify = httpclient.tls(cadata=ca_pem)
    with httpclient.client(verify=verify, timeout=timeout, transport=transport) as http:
        answer = _post(http, f"{url}{AgentPaths.JOIN}", body, timeout)
    cert = x509.load_pem_x509_certificate(answer["cert"].encode())
    if not pki.key_matches(cert, key) or pki.common_name(cert) != node_id:
        raise JoinError(f"the control plane at {shown_url(url)} answered a certificate for "
                        f"{pki.common_name(cert)!r} or another key; run the join again")
    atomic_write(key_path, pki.key_pem(key), mode=0o600)
    atomic_write(cert_path, answer["cert"], mode=0o644)
    atomic_write(ca_path, ca_pem, mode=0o644)
    return Joined(node_id, Path(cert_path), Path(ca_path), str(answer.get("mirror") or ""))


def pinned_ca(url: str, expected: str, timeout: float) -> str:
    """The control plane's CA, fetched without trusting anyone, kept only if its hash is
    the one pinned."""
    # Not verified on purpose: nothing is trusted yet; the hash below is the trust.
    with httpclient.answered(JoinError, f"the control plane at {shown_url(url)}", timeout=timeout,
                              then="; check --join and that port 7443 is reachable from "
                                   "this machine"):
        response = httpclient.request("GET", f"{url}{AgentPaths.JOIN_CA}", verify=False,
                                       timeout=timeout)
    if response.status_code != 200:
        raise JoinError(f"the control plane at {shown_url(url)} did not hand out its CA "
                        f"({response.status_code}: {response.text[:300]})")
    ca_pem = str(response.json().get("ca", ""))
    found = pki.ca_hash(x509.load_pem_x509_certificate(ca_pem.encode()))
    if not hmac.compare_digest(found, _normal(expected)):
        raise JoinError(f"the CA at {shown_url(url)} has hash {found}, but --ca-hash is "
                        f"{_normal(expected)}; this is not the control plane the token came "
                        "from (or the hash was mistyped): check both and run again")
    return ca_pem


def _normal(ca_hash: str) -> str:
    value = ca_hash.strip().lower()
    return value if value.startswith("sha256:") else f"sha256:{value}"


def _post(http: httpx.Client, url: str, body: dict[str, str],
          timeout: float) -> dict[str, str]:
    try:
        response = http.post(url, json=body)
    except httpx.HTTPError as e:
        raise JoinError(f"the join at {shown_url(url)} failed: "
                        f"{httpclient.reason(e, timeout)}") from e
    if response.status_code != 200:
        raise JoinError(f"the control plane refused the join ({response.status_code}): "
                        f"{refusal(response)}")
    return response.json()


def refusal(response: httpx.Response) -> str:
    """What a refusing control plane said: its JSON `detail`, else the start of its body."""
    try:
        return str(response.json().get("detail", response.text))
    except ValueError:
        return response.text[:300]


def needs_renewal(cert_path: str | Path, before_days: float) -> bool:
    return pki.expires_within(pki.load_cert(cert_path), int(before_days))


def renewal_request(node_id: str) -> tuple[bytes, bytes]:
    """A fresh key (PEM) and a CSR for it; the key is written only once a cert comes back."""
    key = pki.new_key()
    return pki.key_pem(key), pki.make_csr(key, node_id)
