"""The JSON-over-HTTP client core both llmgw clients share: typed errors, a detail line."""

from __future__ import annotations

from typing import Any, ClassVar, Self

import httpx

from llmgw import _httpclient
from llmgw.errors import APIError, shown_url


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
        timeout: float = _httpclient.TIMEOUT_S,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        """token: the admin token (llmgw.admin_token.read_token), sent as a bearer token."""
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        headers = {"Authorization": f"Bearer {token}"} if token else None
        self._http = _httpclient.client(self.base_url, timeout=timeout, transport=transport,
                                        headers=headers)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        with _httpclient.answered(self.error, f"{self.what} at {shown_url(self.base_url)}",
                                  asked=f"{method} {path}",
                                  timeout=kw.get("timeout", self.timeout)):
            response = self._http.request(method, path, **kw)
        if response.status_code == 404:
            raise self.not_found(f"{method} {path}: {detail(response)}", 404)
        if response.status_code >= 400:
            raise self.error(
                f"{self.what} at {shown_url(self.base_url)} answered {method} {path} with "
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
