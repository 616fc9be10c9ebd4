"""The JSON-over-HTTP client core both llmgw clients share: typed errors, a detail line."""

from __future__ import annotations

from typing import Any, ClassVar, Self

import httpx

from llmgw.errors import APIError


class JSONClient:
    """An httpx client of one JSON API; subclasses name the API and their error types.

    Errors take (message, status): `not_found` for 404, `error` for everything else,
    including no answer at all (status None).
    """

    what: ClassVar[str] = "the API"
    error: ClassVar[type[APIError]] = APIError
    not_found: ClassVar[type[APIError]] = APIError

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        timeout: float = 10.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        """token: the admin token (llmgw.admin_token.read_token), sent as a bearer token."""
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        headers = {"Authorization": f"Bearer {token}"} if token else None
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout, transport=transport,
                                  headers=headers)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        try:
            response = self._http.request(method, path, **kw)
        except httpx.HTTPError as e:
            raise self.error(
                f"{self.what} at {self.base_url} did not answer {method} {path}: "
                f"{e or type(e).__name__}"
            ) from e
        if response.status_code == 404:
            raise self.not_found(f"{method} {path}: {detail(response)}", 404)
        if response.status_code >= 400:
            raise self.error(
                f"{self.what} at {self.base_url} answered {method} {path} with "
                f"{response.status_code}: {detail(response)}",
                response.status_code,
            )
        return response.json() if response.content else None


def detail(response: httpx.Response) -> str:
    """The reason an API gave: FastAPI's `detail`, else the start of the body."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(body, dict) and "detail" in body:
        return str(body["detail"])
    return str(body)[:500]
