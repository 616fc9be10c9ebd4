"""The agent's side of the agent API: heartbeats over mutual TLS."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import httpx
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from llmgw import httpclient
from llmgw.agent.join import refusal
from llmgw.config import TLSFiles
from llmgw.contract import AgentPaths
from llmgw.contract.records import (
    DriftReport,
    Heartbeat,
    HeartbeatAnswer,
    HostDrift,
    NodeView,
    WatchAnswer,
)
from llmgw.errors import APIError, Unreachable, shown_url
from llmgw.host import pki
from llmgw.host.files import atomic_write


class AgentAPIError(APIError):
    """The control plane's agent API refused this node, or answered wrongly; or the node's
    TLS files do not load. No answer at all is Unreachable (llmgw.errors)."""


class NodeRemoved(AgentAPIError):
    """The control plane revoked this node's certificate: it was removed from the cluster."""

    @property
    def transient(self) -> bool:
        return False  # asking again meets the same revocation list


# Longer than any heartbeat interval: the connection is kept from beat to beat, not made
# again each time (a TLS handshake per beat is what capped the node count).
KEEPALIVE_S = 120.0
# A watch's client waits this long for its answer: the control plane holds one for 55 s
# (control._watch.HOLD_S), and answers unchanged then.
WATCH_TIMEOUT_S = 75.0
_REVOKED = "CERTIFICATE_REVOKED"


def client_context(tls: TLSFiles) -> ssl.SSLContext:
    """Trust only the cluster CA; prove this node with its certificate."""
    try:
        return httpclient.tls(ca=tls.ca, cert=tls.cert, key=tls.key)
    except (OSError, ssl.SSLError) as e:
        raise AgentAPIError(
            f"cannot load the node's TLS files (ca {tls.ca}, cert {tls.cert}, key {tls.key}): "
            f"{e}; run `pytest provision/` to issue them, or fix tls in agent.yaml"
        ) from e


class AgentClient(httpclient.JSONClient):
    """The agent API at server (https://HOST:PORT), as this node: mutual TLS with the node's
    certificate; no answer is Unreachable, and the agent moves to another control plane."""

    what = "the control plane"
    error = AgentAPIError
    not_found = AgentAPIError

    def __init__(
        self,
        server: str,
        tls: TLSFiles,
        *,
        timeout: float = httpclient.TIMEOUT_S,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.tls = tls
        super().__init__(server, timeout=timeout, transport=transport)

    def _connect(self) -> httpx.Client:
        verify: httpclient.Verify = (client_context(self.tls) if self._transport is None
                                      else True)
        limits = httpx.Limits(max_connections=4, keepalive_expiry=KEEPALIVE_S)
        return httpclient.client(self.base_url, verify=verify, timeout=self.timeout,
                                  transport=self._transport, limits=limits)

    @property
    def server(self) -> str:
        """The control plane this client sends to (https://HOST:PORT)."""
        return self.base_url

    @property
    def shown(self) -> str:
        """The control plane's URL as a message shows it (errors.shown_url)."""
        return shown_url(self.base_url)

    def move_to(self, server: str) -> None:
        """Send to the control plane at server from now on: a new connection, whose TLS
        checks that server's certificate names server's host, signed by the same CA."""
        self._http.close()
        self.base_url = server.rstrip("/")
        self._http = self._connect()

    def heartbeat(self, inventory: Heartbeat) -> HeartbeatAnswer:
        """Send the inventory; the answer holds node_id (from the certificate) and replicas."""
        return self._call("POST", AgentPaths.HEARTBEAT, json=inventory)

    def watch(self, since: str) -> WatchAnswer:
        """Held until this node's assignments differ from revision since (changed: beat
        now), or unchanged after the control plane's hold; its answer is waited for
        WATCH_TIMEOUT_S (the client's own timeout still bounds the connect). An
        AgentAPIError with status 404 from a control plane older than the watch."""
        return self._call("GET", AgentPaths.WATCH, params={"since": since},
                          timeout=httpx.Timeout(self.timeout, read=WATCH_TIMEOUT_S))

    def node(self) -> NodeView | None:
        """This node's record as the control plane sees it (GET /api/v1/agent/self); None
        until it has sent a heartbeat."""
        response = self._send("GET", AgentPaths.SELF)
        return None if response.status_code == 404 else self._answer(
            "GET", AgentPaths.SELF, response)

    def revocation_list(self) -> bytes:
        """The cluster's revocation list (PEM) as the control plane issues it now; whoever
        takes it checks it against the cluster CA (llmgw.agent.revocation)."""
        answer = self._call("GET", AgentPaths.CRL)
        return str(answer["crl"]).encode()

    def report_drift(self, report: DriftReport) -> HostDrift:
        """This node's last round of `llmgw check --serve`; the control plane keeps it under
        this node's certificate's name."""
        return self._call("PUT", AgentPaths.DRIFT, json=report)

    def renew(self, key_pem: bytes, csr_pem: bytes) -> None:
        """Swap this node's certificate for a new one over the current mTLS connection; the
        new key and certificate replace the files in tls, then new connections use them."""
        answer = self._call("POST", AgentPaths.RENEW, json={"csr": csr_pem.decode()})
        atomic_write(self.tls.key + ".new", key_pem, mode=0o600)
        atomic_write(self.tls.cert, answer["cert"], mode=0o644)
        Path(self.tls.key + ".new").replace(self.tls.key)
        self._http.close()
        self._http = self._connect()

    def _request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            return self._http.request(method, path, **kw)
        except httpx.RemoteProtocolError:
            # A kept-alive connection the server closed while idle (or because it dropped
            # this node): one fresh connection says which.
            return self._http.request(method, path, **kw)

    def _unanswered(self, e: httpx.HTTPError, asked: str,
                    timeout: httpclient.Timeout) -> APIError:
        """NodeRemoved when the control plane refused this node's certificate as revoked,
        else Unreachable: another control plane of the fleet may answer."""
        # A revoked certificate is refused in the handshake, never left unanswered: no
        # second wait for the revocation list of a control plane that does not answer.
        if not isinstance(e, httpx.TimeoutException) and (
                _REVOKED in str(e).upper().replace(" ", "_") or self._revoked()):
            return NodeRemoved(
                f"the control plane at {self.shown} refused this node's certificate as "
                "revoked: the node was removed (llmgw node rm). Join it again with a new "
                "token to serve"
            )
        return Unreachable(httpclient.no_answer(e, f"the control plane at {self.shown}",
                                                timeout=self.timeout))

    def _revoked(self) -> bool:
        """Whether the control plane's revocation list, signed by the cluster CA, names
        this node's certificate; False when that cannot be told."""
        try:
            ctx = httpclient.tls(ca=self.tls.ca)
            with httpclient.client(verify=ctx, timeout=self.timeout,
                                    transport=self._transport) as anonymous:
                crl_pem = anonymous.get(f"{self.base_url}{AgentPaths.CRL}").json()["crl"]
            crl = x509.load_pem_x509_crl(crl_pem.encode())
            ca, cert = pki.load_cert(self.tls.ca), pki.load_cert(self.tls.cert)
            public = ca.public_key()
            signed = isinstance(public, ec.EllipticCurvePublicKey) and crl.is_signature_valid(
                public)
        except (httpx.HTTPError, OSError, ssl.SSLError, ValueError, KeyError, pki.PKIError):
            return False
        return signed and crl.get_revoked_certificate_by_serial_number(
            cert.serial_number) is not None

    def _answer(self, method: str, path: str, response: httpx.Response) -> Any:
        """The answer's JSON object (the caller's annotation names its shape), or the error
        saying what came instead: a 503 is Unreachable (it answers but cannot serve: its
        store is away), any other status but 200 an AgentAPIError."""
        status = response.status_code
        if status == 503:
            raise Unreachable(f"the control plane at {self.shown} cannot serve now (503): "
                              f"{refusal(response)}", 503)
        if status != 200:
            raise AgentAPIError(
                f"the control plane at {self.shown} answered {status}: {response.text[:300]}",
                status)
        body = response.json()
        if not isinstance(body, dict):
            raise AgentAPIError(f"the control plane at {self.shown} answered {body!r}", status)
        return body
