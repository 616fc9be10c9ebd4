"""A client of the admin API, used by the harness and by people's scripts."""

from __future__ import annotations

from collections.abc import Mapping

from llmgw.contract import AdminPaths, records
from llmgw.errors import APIError
from llmgw.httpclient import JSONClient


class ControlPlaneError(APIError):
    """The admin API could not be reached or answered with an error."""


class NotFound(ControlPlaneError):
    """The admin API answered 404."""


class AdminClient(JSONClient):
    """The admin API at base_url (http://127.0.0.1:9090 by default)."""

    what = "the control plane's admin API"
    error = ControlPlaneError
    not_found = NotFound

    def health(self) -> dict[str, str]:
        return self._call("GET", AdminPaths.HEALTH)

    def nodes(self, limit: int | None = None, after: str = "") -> list[records.NodeView]:
        params: dict[str, int | str] = {}
        if limit is not None:
            params = {"limit": limit, "after": after}
        return self._call("GET", AdminPaths.NODES, params=params)

    def remove_node(self, node_id: str) -> records.NodeRemoval:
        """Drain the node's replicas and refuse its certificate from now on."""
        return self._call("DELETE", AdminPaths.node(node_id))

    def create_token(self, ttl_s: float, bundle: str = "") -> records.JoinToken:
        """A single-use join token: {token, expires}; with a sealed bundle, one that makes
        another control plane."""
        return self._call("POST", AdminPaths.TOKENS, json={"ttl_s": ttl_s, "bundle": bundle})

    def node(self, node_id: str) -> records.NodeView | None:
        return next((n for n in self.nodes() if n["id"] == node_id), None)

    def models(self) -> list[records.ModelSpec]:
        return self._call("GET", AdminPaths.MODELS)

    def add_model(self, model: Mapping[str, object]) -> records.ModelSpec:
        return self._call("POST", AdminPaths.MODELS, json=model)

    def delete_model(self, name: str) -> None:
        self._call("DELETE", AdminPaths.model(name))

    def replicas(self, model: str | None = None) -> list[records.PublicReplica]:
        params = {"model": model} if model else None
        return self._call("GET", AdminPaths.REPLICAS, params=params)

    def create_key(self, *, name: str = "", models: list[str] | None = None, rpm: int = 0,
                   tpm: int = 0, expires: float | None = None) -> records.NewKey:
        """A gateway key: the answer's `key` is its secret, shown this once."""
        return self._call("POST", AdminPaths.KEYS, json={
            "name": name, "models": models or [], "rpm": rpm, "tpm": tpm, "expires": expires})

    def keys(self) -> list[records.PublicKey]:
        return self._call("GET", AdminPaths.KEYS)

    def revoke_key(self, name: str) -> records.PublicKey:
        """Revoke the key of this name, prefix or id."""
        return self._call("DELETE", AdminPaths.key(name))

    def create_viewer(self, *, name: str = "", expires: float | None = None) -> records.NewViewer:
        """A viewer key (reads only) that expires at expires (unix seconds; None: never):
        the answer's `key` is its secret, shown this once."""
        return self._call("POST", AdminPaths.VIEWERS, json={"name": name, "expires": expires})

    def viewers(self) -> list[records.PublicViewer]:
        return self._call("GET", AdminPaths.VIEWERS)

    def revoke_viewer(self, name: str) -> records.PublicViewer:
        """Revoke the viewer key of this name, prefix or id."""
        return self._call("DELETE", AdminPaths.viewer(name))

    def report_drift(self, host: str, report: records.DriftReport) -> records.HostDrift:
        """A host's last round of checks: {checked, promises, failing: [{promise, since,
        message}]}."""
        return self._call("PUT", AdminPaths.drift(host), json=report)

    def control_planes(self) -> list[records.ControlPlaneView]:
        """The control planes sharing the store; `scheduling` marks the one that schedules.
        NotFound from a control plane older than the listing."""
        return self._call("GET", AdminPaths.CONTROL_PLANES)

    def drift(self) -> list[records.HostDrift]:
        """Every host's last round of checks, as `llmgw check --serve` reported it."""
        return self._call("GET", AdminPaths.DRIFT)

    def replica_logs(self, replica: str, lines: int = 50) -> records.ReplicaLog:
        return self._call("GET", AdminPaths.replica_logs(replica), params={"n": lines})

    def metrics(self) -> str:
        response = self._http.get(AdminPaths.METRICS)
        response.raise_for_status()
        return response.text
