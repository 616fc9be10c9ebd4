"""A client of the admin API, used by the harness and by people's scripts."""

from __future__ import annotations

from typing import Any

import httpx

from llmgw.errors import Error


class ControlPlaneError(Error):
    """The admin API could not be reached or answered with an error."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class NotFound(ControlPlaneError):
    """The admin API answered 404."""


class AdminClient:
    """The admin API at base_url (http://127.0.0.1:9090 by default)."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 10.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout, transport=transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        try:
            response = self._http.request(method, path, **kw)
        except httpx.HTTPError as e:
            raise ControlPlaneError(
                f"the control plane's admin API at {self.base_url} did not answer "
                f"{method} {path}: {e or type(e).__name__}"
            ) from e
        if response.status_code == 404:
            raise NotFound(f"{method} {path}: {_detail(response)}", 404)
        if response.status_code >= 400:
            raise ControlPlaneError(
                f"{method} {path} answered {response.status_code}: {_detail(response)}",
                response.status_code,
            )
        return response.json() if response.content else None

    def health(self) -> dict[str, Any]:
        return self._call("GET", "/healthz")

    def nodes(self) -> list[dict[str, Any]]:
        return self._call("GET", "/api/v1/nodes")

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


def _detail(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(body, dict) and "detail" in body:
        return str(body["detail"])
    return str(body)[:500]
