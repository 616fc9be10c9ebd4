"""The agent's side of the agent API: heartbeats over mutual TLS."""

from __future__ import annotations

import ssl
from typing import Any

import httpx

from llmgw.config import TLSFiles
from llmgw.control.agent_api import HEARTBEAT_PATH
from llmgw.errors import Error


class AgentAPIError(Error):
    """The control plane's agent API could not be reached, refused us, or answered wrongly."""


def client_context(tls: TLSFiles) -> ssl.SSLContext:
    """Trust only the cluster CA; prove this node with its certificate."""
    try:
        ctx = ssl.create_default_context(cafile=tls.ca)
        ctx.load_cert_chain(tls.cert, tls.key)
    except (OSError, ssl.SSLError) as e:
        raise AgentAPIError(
            f"cannot load the node's TLS files (ca {tls.ca}, cert {tls.cert}, key {tls.key}): "
            f"{e}; run `pytest provision/` to issue them, or fix tls in agent.yaml"
        ) from e
    return ctx


class AgentClient:
    """The agent API at server (https://HOST:PORT), as this node."""

    def __init__(
        self,
        server: str,
        tls: TLSFiles,
        *,
        timeout: float = 10.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.server = server.rstrip("/")
        verify: ssl.SSLContext | bool = client_context(tls) if transport is None else True
        self._http = httpx.Client(
            base_url=self.server, verify=verify, timeout=timeout, transport=transport
        )

    def close(self) -> None:
        self._http.close()

    def heartbeat(self, inventory: dict[str, Any]) -> dict[str, Any]:
        """Send the inventory; the answer holds node_id (from the certificate) and replicas."""
        try:
            response = self._http.post(HEARTBEAT_PATH, json=inventory)
        except httpx.HTTPError as e:
            raise AgentAPIError(
                f"the control plane at {self.server} did not answer: {e or type(e).__name__}"
            ) from e
        if response.status_code != 200:
            raise AgentAPIError(
                f"the control plane at {self.server} answered {response.status_code}: "
                f"{response.text[:300]}"
            )
        body = response.json()
        if not isinstance(body, dict):
            raise AgentAPIError(f"the control plane at {self.server} answered {body!r}")
        return body
