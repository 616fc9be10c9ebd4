"""Sources a model is downloaded from: hf:ORG/REPO/FILE[@REVISION], https://, http://
and file:///."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self
from urllib.parse import quote, unquote, urlsplit

import httpx

from llmgw.errors import Error, shown_url
from llmgw.mirror._disk import is_name
from llmgw.mirror._errors import SourceError

HUB_DEFAULT = "https://huggingface.co"
CHUNK = 1 << 20
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")
_UNSATISFIED = re.compile(r"^bytes \*/(\d+)$")


def hub_endpoint() -> str:
    """The model hub hf: sources resolve against; HF_ENDPOINT names a hub mirror, as the
    hub's own client reads it."""
    return (os.environ.get("HF_ENDPOINT") or HUB_DEFAULT).rstrip("/")


# What the mirror's downloads read from their environment: the hub's address and token (as
# the hub's own client reads them) and the proxy httpx follows on the way there.
HUB_ENV = ("HF_ENDPOINT", "HF_TOKEN", "HTTPS_PROXY", "HTTP_PROXY", "NO_PROXY")


def hub_token() -> str:
    """The hub's access token (HF_TOKEN, as the hub's own client reads it); '' when none."""
    return os.environ.get("HF_TOKEN", "").strip()


def hub_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Those of HUB_ENV that are set and not empty: what the mirror service needs."""
    environ = os.environ if environ is None else environ
    return {k: environ[k] for k in HUB_ENV if environ.get(k)}


def hub_variables_given(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Those of HUB_ENV that are set at all, empty ones included: a variable set and empty
    (`HF_TOKEN=`) says to take it away, one not set says nothing."""
    environ = os.environ if environ is None else environ
    return {k: environ[k] for k in HUB_ENV if k in environ}


def proxy_for(url: str, environ: Mapping[str, str]) -> str:
    """The proxy URL httpx would take to url with environ's HTTPS_PROXY, HTTP_PROXY and
    NO_PROXY ('' for none): the mirror's way to the hub."""
    parts = urlsplit(url)
    proxy = environ.get(f"{parts.scheme.upper()}_PROXY", "")
    if not proxy or _bypassed(parts.hostname or "", environ.get("NO_PROXY", "")):
        return ""
    return proxy


def _bypassed(host: str, no_proxy: str) -> bool:
    """NO_PROXY as curl and httpx read it: `*`, or names that match host or a domain it is
    in (`example.com` and `.example.com` both take `hub.example.com`); ports ignored."""
    for entry in (e.strip().lower() for e in no_proxy.split(",")):
        name = entry.rsplit(":", 1)[0] if entry.count(":") == 1 else entry
        name = name.strip("[]").lstrip(".")
        if entry == "*" or (name and (host == name or host.endswith(f".{name}"))):
            return True
    return False


@dataclass(frozen=True)
class Source:
    """A source as given, the URL it is read from, the file name it gets in the mirror,
    and the bearer token sent with it (the hub's, to the hub only)."""

    spec: str
    url: str
    file_name: str
    token: str = field(default="", repr=False)


def parse(spec: str) -> Source:
    """Turn a source as written in a fetch into a URL and a file name; SourceError if it cannot."""
    token = ""
    if spec.startswith("hf:"):
        url = _hub_url(spec)
        token = hub_token()
    elif spec.startswith(("https://", "http://", "file:///")):
        url = spec
    else:
        raise SourceError(
            f"source {shown_url(spec)!r} has a scheme the mirror does not know; "
            "use hf:ORG/REPO/FILE, https://..., http://... or file:///path"
        )
    name = unquote(urlsplit(url).path.rsplit("/", 1)[-1])
    if not is_name(name):
        raise SourceError(
            f"source {shown_url(spec)!r} ends in {name!r}, which cannot be a file name in the "
            "mirror (letters, digits, . _ + - only, not starting with a dot); name the file itself"
        )
    return Source(spec, url, name, token)


def _hub_url(spec: str) -> str:
    """hf:ORG/REPO/FILE[@REVISION] → the hub's resolve URL (revision main by default)."""
    path, at, revision = spec[3:].partition("@")
    parts = path.split("/")
    if len(parts) < 3 or not all(parts) or (at and not revision):
        raise SourceError(
            f"source {spec!r} is not hf:ORG/REPO/FILE[@REVISION]; write e.g. "
            "hf:Qwen/Qwen2.5-0.5B-Instruct-GGUF/qwen2.5-0.5b-instruct-q4_k_m.gguf (or "
            "…@main, @a commit, @refs/pr/1)"
        )
    repo, file = "/".join(parts[:2]), "/".join(parts[2:])
    return f"{hub_endpoint()}/{quote(repo)}/resolve/{quote(revision or 'main', safe='')}/" \
        f"{quote(file)}"


def stated_digest(value: str | None) -> str | None:
    """A sha256 from an ETag-like header ('"abc…"', W/"abc…"), or None when it is not one."""
    if not value:
        return None
    value = value.strip().removeprefix("W/").strip('"').lower()
    return value if _SHA256.match(value) else None


@dataclass
class Opened:
    """A source opened at an offset: where its bytes start, and what it says of the whole."""

    start: int
    total: int | None
    digest: str | None
    validator: str | None
    chunks: Iterator[bytes]
    close: list = field(default_factory=list)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        for closer in self.close:
            closer()


class Changed(Error):
    """The source no longer is the file a partial download came from; start over."""


class Gone(Error):
    """The source answered in a way a retry will not fix (404, 403, …)."""


class Unavailable(Error):
    """The source is busy or failing for now (5xx, 429): worth another try."""


def open_at(source: Source, offset: int, validator: str | None, client: httpx.Client) -> Opened:
    """Open the source from offset on. Opened.start is 0 when the source sent the whole file."""
    if source.url.startswith("file://"):
        return _open_file(Path(unquote(urlsplit(source.url).path)), offset, validator)
    return _open_http(source.url, offset, validator, client, source.token)


def _open_file(path: Path, offset: int, validator: str | None) -> Opened:
    try:
        f = path.open("rb")
    except OSError as e:
        raise Gone(f"cannot read {path}: {e.strerror}") from e
    st = os.fstat(f.fileno())
    current = f"{st.st_mtime_ns}-{st.st_size}"
    start = offset if validator in (None, current) and offset <= st.st_size else 0
    f.seek(start)
    return Opened(start, st.st_size, None, current, iter(lambda: f.read(CHUNK), b""), [f.close])


def _digest_in(response: httpx.Response) -> str | None:
    # The hub states a file's sha256 as X-Linked-Etag on the redirect to its CDN.
    for r in [*response.history, response]:
        for header in ("x-linked-etag", "etag"):
            found = stated_digest(r.headers.get(header))
            if found:
                return found
    return None


def _open_http(url: str, offset: int, validator: str | None, client: httpx.Client,
               token: str = "") -> Opened:
    # Identity, so the bytes hashed are the file's bytes, never a compressed form of them.
    headers = {"Accept-Encoding": "identity"}
    if token:
        # httpx drops it on a redirect to another origin (the hub's CDN), so it reaches
        # the hub only.
        headers["Authorization"] = f"Bearer {token}"
    if offset:
        headers["Range"] = f"bytes={offset}-"
        if validator:
            headers["If-Range"] = validator
    response = client.send(client.build_request("GET", url, headers=headers), stream=True)
    # Said by shown_url: HF_ENDPOINT, or the source itself, may carry `user:password@`.
    shown = shown_url(url)
    closer = [response.close]
    status = response.status_code
    if status == 416:
        response.close()
        found = _UNSATISFIED.match(response.headers.get("content-range", ""))
        if found and int(found[1]) == offset:
            return Opened(offset, offset, _digest_in(response), validator, iter(()), [])
        raise Changed(f"{shown} answered 416 to a resume at byte {offset}")
    if status >= 500 or status == 429:
        response.close()
        raise Unavailable(f"{shown} answered {status} {response.reason_phrase}")
    if status >= 400:
        response.close()
        raise Gone(f"{shown} answered {status} {response.reason_phrase}")
    start, total = 0, _int(response.headers.get("content-length"))
    if status == 206:
        found = _CONTENT_RANGE.match(response.headers.get("content-range", ""))
        if not found or int(found[1]) != offset:
            response.close()
            raise Changed(f"{shown} answered a range other than the one asked for")
        start, total = offset, None if found[3] == "*" else int(found[3])
    new_validator = response.headers.get("etag") or response.headers.get("last-modified")
    chunks = response.iter_raw()
    return Opened(start, total, _digest_in(response), new_validator, chunks, closer)


def _int(text: str | None) -> int | None:
    return int(text) if text and text.isdigit() else None
