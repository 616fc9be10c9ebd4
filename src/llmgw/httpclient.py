"""The one maker of llmgw's httpx clients for control traffic: their TLS, their timeouts,
and a failure to answer told in llmgw's words; and JSONClient, the JSON API client on them.

Agent, CLI, mirror and harness make every httpx client here, sync or async, and nowhere
else (tests/test_httpclient.py holds that); the data plane's upstream client is another
(gateway/_upstream.py).
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, ClassVar, Self, TypedDict, Unpack

import httpx

from llmgw.errors import APIError, shown_url

# Connecting, and each read, when the caller names no timeout of its own.
TIMEOUT_S = 10.0

# What a client verifies the server's certificate with: a context (tls()), True for the
# system's roots, False for nothing (only where a pinned hash is the trust).
Verify = ssl.SSLContext | bool
Timeout = float | httpx.Timeout


def tls(
    *,
    ca: str | os.PathLike[str] | None = None,
    cadata: str | None = None,
    cert: str | os.PathLike[str] | None = None,
    key: str | os.PathLike[str] | None = None,
) -> ssl.SSLContext:
    """A client context that trusts only ca (a PEM file) or cadata (PEM text), else the
    system's roots, and proves itself with cert and key when given (mutual TLS).

    Raises OSError or ssl.SSLError when a file does not load: the caller knows which files
    they are and what makes them, so it says so."""
    ctx = ssl.create_default_context(cafile=ca, cadata=cadata)
    if cert is not None:
        ctx.load_cert_chain(cert, key)
    return ctx


class Options(TypedDict, total=False):
    """What client() and async_client() take beside the base URL and the transport; one
    left out is the default _options() gives."""

    verify: Verify  # True
    timeout: Timeout  # TIMEOUT_S
    headers: Mapping[str, str] | None  # None
    limits: httpx.Limits | None  # httpx's own
    follow_redirects: bool  # False


def _options(base_url: str, given: Options) -> dict[str, Any]:
    options: dict[str, Any] = {"base_url": base_url, "verify": True, "timeout": TIMEOUT_S,
                               "headers": None, "follow_redirects": False, **given}
    if options.get("limits") is None:
        options.pop("limits", None)
    return options


def client(base_url: str = "", *, transport: httpx.BaseTransport | None = None,
           **options: Unpack[Options]) -> httpx.Client:
    """A sync client; transport replaces the network (tests: httpx.MockTransport)."""
    return httpx.Client(transport=transport, **_options(base_url, options))


def async_client(base_url: str = "", *, transport: httpx.AsyncBaseTransport | None = None,
                 **options: Unpack[Options]) -> httpx.AsyncClient:
    """An async client, made as client() makes a sync one."""
    return httpx.AsyncClient(transport=transport, **_options(base_url, options))


def request(method: str, url: str, *, verify: Verify = True, timeout: Timeout = TIMEOUT_S,
            **kw: Any) -> httpx.Response:
    """One request on a client of its own (a probe's), its answer read whole."""
    with client(verify=verify, timeout=timeout) as http:
        return http.request(method, url, **kw)


@contextmanager
def stream(method: str, url: str, *, verify: Verify = True, timeout: Timeout = TIMEOUT_S,
           **kw: Any) -> Iterator[httpx.Response]:
    """One request on a client of its own whose answer is read as it comes."""
    with client(verify=verify, timeout=timeout) as http, \
            http.stream(method, url, **kw) as response:
        yield response


def _waited(e: httpx.HTTPError, timeout: Timeout | None) -> float | None:
    """The seconds the request waited before e, a timeout: the phase's own (connect, read,
    write, pool) when timeout says them apart; None when e is no timeout or none is given."""
    if not isinstance(e, httpx.TimeoutException) or timeout is None:
        return None
    if not isinstance(timeout, httpx.Timeout):
        return timeout
    phase = {httpx.ConnectTimeout: timeout.connect, httpx.ReadTimeout: timeout.read,
             httpx.WriteTimeout: timeout.write, httpx.PoolTimeout: timeout.pool}
    return phase.get(type(e), timeout.read)


def reason(e: httpx.HTTPError, timeout: Timeout | None = None) -> str:
    """Why no answer came, in a few words: for a timeout the wait when timeout is given,
    else httpx's words (the error's name when it has none)."""
    waited = _waited(e, timeout)
    if waited is not None:
        return f"no answer within {waited:g}s ({type(e).__name__})"
    return str(e) or type(e).__name__


def no_answer(e: httpx.HTTPError, who: str, *, asked: str = "",
              timeout: Timeout | None = None) -> str:
    """'{who} did not answer {asked}: why', or '... within Ns (ReadTimeout)' for a timeout
    when timeout is given."""
    did = f"{who} did not answer" + (f" {asked}" if asked else "")
    waited = _waited(e, timeout)
    if waited is not None:
        return f"{did} within {waited:g}s ({type(e).__name__})"
    return f"{did}: {reason(e)}"


@contextmanager
def answered(error: Callable[[str], BaseException], who: str, *, asked: str = "",
             timeout: Timeout | None = None, then: str = "") -> Iterator[None]:
    """Turn an httpx failure inside into error(no_answer(...) + then): then says what to do."""
    try:
        yield
    except httpx.HTTPError as e:
        raise error(no_answer(e, who, asked=asked, timeout=timeout) + then) from e


# The JSON-over-HTTP client core every llmgw client shares (the admin API's, the mirror's and
# the agent API's), on the clients above: typed errors, a detail line.
class JSONClient:
    """An httpx client of one JSON API; subclasses name the API and their error types.

    Errors take (message, status): `not_found` for 404, `error` for everything else,
    including no answer at all (status None). A subclass with TLS or limits of its own
    overrides _connect; one that words its errors otherwise, _unanswered and _answer.
    """

    what: ClassVar[str] = "the API"
    error: ClassVar[type[APIError]] = APIError
    not_found: ClassVar[type[APIError]] = APIError

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        timeout: float = TIMEOUT_S,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        """token: the admin token (llmgw.host.admin_token.read_token), sent as a bearer token."""
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._transport = transport
        self._headers = {"Authorization": f"Bearer {token}"} if token else None
        self._http = self._connect()

    def _connect(self) -> httpx.Client:
        """A new httpx client of base_url (made again when the URL or the TLS files change)."""
        return client(self.base_url, timeout=self.timeout, transport=self._transport,
                      headers=self._headers)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        return self._answer(method, path, self._send(method, path, **kw))

    def _send(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """The answer to one request, whatever its status; _unanswered's error when none came."""
        try:
            return self._request(method, path, **kw)
        except httpx.HTTPError as e:
            raise self._unanswered(e, f"{method} {path}", kw.get("timeout", self.timeout)) from e

    def _request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        return self._http.request(method, path, **kw)

    def _unanswered(self, e: httpx.HTTPError, asked: str, timeout: Timeout) -> APIError:
        """The error for a request that got no answer (status None)."""
        return self.error(no_answer(e, f"{self.what} at {shown_url(self.base_url)}",
                                    asked=asked, timeout=timeout))

    def _answer(self, method: str, path: str, response: httpx.Response) -> Any:
        """The answer's JSON (None when it has no body), or the error its status says."""
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
