"""A client of the admin API, used by the harness and by people's scripts."""

from __future__ import annotations

from typing import Any

from llmgw._jsonclient import JSONClient
from llmgw.errors import APIError


class ControlPlaneError(APIError):
    """The admin API could not be reached or answered with an error."""


class NotFound(ControlPlaneError):
    """The admin API answered 404."""


class AdminClient(JSONClient):
    """The admin API at base_url (http://127.0.0.1:9090 by default)."""

    what = "the control plane's admin API"
    error = ControlPlaneError
    not_found = NotFound

    def health(self) -> dict[str, Any]:
        return self._call("GET", "/healthz")

    def nodes(self, limit: int | None = None, after: str = "") -> list[dict[str, Any]]:
        params: dict[str, Any] = {}
        if limit is not None:
            params = {"limit": limit, "after": after}
        return self._call("GET", "/api/v1/nodes", params=params)

    def remove_node(self, node_id: str) -> dict[str, Any]:
        """Drain the node's replicas and refuse its certificate from now on."""
        return self._call("DELETE", f"/api/v1/nodes/{node_id}")

    def create_token(self, ttl_s: float) -> dict[str, Any]:
        """A single-use join token: {token, expires}."""
        return self._call("POST", "/api/v1/tokens", json={"ttl_s": ttl_s})

    def node(self, node_id: str) -> dict[str, Any] | None:
        return next((n for n in self.nodes() if n["id"] == node_id), None)

    def models(self) -> list[dict[str, Any]]:
        return self._call("GET", "/api/v1/models")

    def add_model(self, model: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", "/api/v1/models", json=model)

    def delete_model(self, name: str) -> None:
        self._call("DELETE", f"/api/v1/models/{name}")

    def replicas(self, model: str | None = None) -> list[dict[str, Any]]:
        params = {"model": model} if model else None
        return self._call("GET", "/api/v1/replicas", params=params)


    def report_drift(self, host: str, report: dict[str, Any]) -> dict[str, Any]:
        """A host's last round of checks: {checked, promises, failing: [{promise, since,
        message}]}."""
        return self._call("PUT", f"/api/v1/drift/{host}", json=report)

    def drift(self) -> list[dict[str, Any]]:
        """Every host's last round of checks, as `llmgw check --serve` reported it."""
        return self._call("GET", "/api/v1/drift")

    def replica_logs(self, replica: str, lines: int = 50) -> dict[str, Any]:
        return self._call("GET", f"/api/v1/replicas/{replica}/logs", params={"n": lines})

    def metrics(self) -> str:
        response = self._http.get("/metrics")
        response.raise_for_status()
        return response.text
