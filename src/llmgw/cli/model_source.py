"""What `llmgw models add SOURCE` reads: a source (hf:, https://, a local file) resolved
without the network, brought to a local file with progress, and its GGUF header read."""

from __future__ import annotations

import hashlib
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import httpx

from llmgw import httpclient
from llmgw.contract.records import Geometry
from llmgw.errors import Error, shown_url
from llmgw.mirror._errors import SourceError
from llmgw.mirror._sources import (
    Gone,
    Opened,
    Source,
    Unavailable,
    hub_endpoint,
    open_at,
    parse,
)
from llmgw.model.ggufmeta import MAGIC, GGUFError, general_name, geometry

# A source with a scheme of its own (`s3://`, `ftp:`), told apart from a local path.
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
REMOTE = ("hf:", "https://", "http://")
FETCH_TIMEOUT = httpx.Timeout(30.0, connect=10.0)
# A progress line at every tenth of the file, or every this many bytes when its size is unknown.
_STEP_UNKNOWN = 256 << 20
_QUIET_S = 1.0
_CHUNK = 1 << 20

Progress = Callable[[int], None]


@dataclass(frozen=True)
class ModelFile:
    """A GGUF model file on this machine, and what its header and bytes say."""

    path: Path
    shown: str  # the source as given, credentials hidden
    sha256: str
    size: int
    general_name: str
    geometry: Geometry


def is_model_source(spec: str) -> bool:
    """Whether spec names a model file (a remote source, file:///, a file that starts with
    the GGUF magic or is named *.gguf) rather than a catalog model in YAML."""
    if spec.startswith((*REMOTE, "file:")) or _SCHEME.match(spec) and not Path(spec).exists():
        return True
    path = Path(spec)
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with path.open("rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def resolve(spec: str) -> Source | Path:
    """A remote source (hf: against HF_ENDPOINT's hub) or a local path, from spec alone: no
    network. SourceError, in one line, for a scheme not known or an hf: path not
    hf:ORG/REPO/FILE.gguf."""
    if spec.startswith("file://"):
        if not spec.startswith("file:///"):
            raise SourceError(f"source {spec!r} is not file:///ABSOLUTE/PATH; give the path")
        return Path(unquote(urlsplit(spec).path))
    if spec.startswith(REMOTE):
        source = parse(spec)
        if spec.startswith("hf:") and not source.file_name.lower().endswith(".gguf"):
            raise SourceError(f"source {spec!r} names {source.file_name!r}, not a .gguf file; "
                              "write hf:ORG/REPO/FILE.gguf (the repo's files list names them)")
        return source
    if _SCHEME.match(spec) and not Path(spec).exists():
        raise SourceError(f"source {shown_url(spec)!r} has a scheme llmgw does not fetch; give "
                          "hf:ORG/REPO/FILE.gguf, an https:// URL or a local .gguf file")
    return Path(spec)


def read_header(path: Path, shown: str = "") -> tuple[int, str, Geometry]:
    """(size, general.name, KV geometry) of a local file, without reading it all; Error (one
    line) when it is missing or unreadable, GGUFError when it is not a GGUF model."""
    shown = shown or str(path)
    try:
        size = path.stat().st_size
        if not path.is_file():
            raise Error(f"{path} is not a file; give a .gguf model file")
        with path.open("rb") as f:
            head = f.read(len(MAGIC))
        if head != MAGIC:
            raise GGUFError(f"{shown} is not a GGUF model file: it starts with {head!r}, not "
                            f"{MAGIC!r}; llama.cpp serves GGUF only: convert it, or pick the "
                            "repo's .gguf file")
        return size, general_name(path), geometry(path)
    except FileNotFoundError:
        raise Error(f"{path} does not exist; give the path of a .gguf model file") from None
    except OSError as e:
        raise Error(f"cannot read {path}: {e.strerror}; check its permissions") from None
    except GGUFError as e:
        if str(e).startswith(shown):
            raise
        raise GGUFError(f"{shown} is not a GGUF file llmgw can read: {e}") from None


def read_local(path: Path, shown: str = "") -> ModelFile:
    """read_header's facts and the file's sha256."""
    size, name, found = read_header(path, shown)
    return ModelFile(path, shown or str(path), _sha256(path), size, name, found)


def download(source: Source, into: Path, progress: Callable[[int | None], Progress], *,
             transport: httpx.BaseTransport | None = None) -> Path:
    """Fetch source to into/FILE (the source's file name), refusing it at its first bytes
    when they are not GGUF's; a partial file is removed on any error."""
    path = into / source.file_name
    try:
        with httpclient.client(follow_redirects=True, timeout=FETCH_TIMEOUT,
                               transport=transport) as client:
            with _opened(source, client) as opened:
                _write(source, opened.chunks, path, progress(opened.total), opened.total,
                       opened.digest)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path


def _opened(source: Source, client: httpx.Client) -> Opened:
    shown = shown_url(source.spec)
    try:
        return open_at(source, 0, None, client)
    except (Gone, Unavailable) as e:
        hint = ("check ORG, REPO, the file's name and the revision; a gated repo needs "
                "HF_TOKEN") if source.spec.startswith("hf:") else "check the URL"
        raise Error(f"cannot fetch {shown}: {e}; {hint}") from None
    except httpx.HTTPError as e:
        why = _one_line(e)
        if "CERTIFICATE" in why:
            raise Error(f"cannot fetch {shown}: {_where(source)} answered with a certificate "
                        f"this machine does not trust ({why}); set SSL_CERT_FILE to a bundle "
                        "that holds its CA, or download the file elsewhere and give its "
                        "path") from None
        raise Error(f"cannot fetch {shown}: {_where(source)} does not answer ({why}); check "
                    "the network and the proxy"
                    f"{', HF_ENDPOINT' if source.spec.startswith('hf:') else ''}, or "
                    "download the file elsewhere and give its path") from None


def _write(source: Source, chunks: Iterator[bytes], path: Path, say: Progress,
           total: int | None, stated: str | None) -> None:
    shown = shown_url(source.spec)
    h, got, head = hashlib.sha256(), 0, b""
    try:
        with path.open("wb") as out:
            for chunk in chunks:
                if len(head) < len(MAGIC):
                    head += chunk[: len(MAGIC) - len(head)]
                    if len(head) == len(MAGIC) and head != MAGIC:
                        raise GGUFError(f"{shown} is not a GGUF model file: it starts with "
                                      f"{head!r}, not {MAGIC!r}; pick the repo's .gguf file")
                out.write(chunk)
                h.update(chunk)
                got += len(chunk)
                say(got)
    except httpx.HTTPError as e:
        raise Error(f"the download of {shown} broke at byte {got} ({_one_line(e)}); run the "
                    "command again") from None
    if head != MAGIC:
        raise GGUFError(f"{shown} is not a GGUF model file: it holds {got} bytes, too few for "
                      "a header; pick the repo's .gguf file")
    if total is not None and got != total:
        raise Error(f"the download of {shown} stopped at byte {got} of {total}; run the "
                    "command again")
    if stated and stated != h.hexdigest():
        raise Error(f"{shown} has sha256 {h.hexdigest()}, not the {stated} its server "
                    "states; run the command again (a proxy may have changed it)")


def _where(source: Source) -> str:
    if source.spec.startswith("hf:"):
        return f"the hub at {shown_url(hub_endpoint())}"
    parts = urlsplit(source.url)
    return f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "")


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def progress_lines(what: str, *, out: Callable[[str], None] | None = None,
                   clock: Callable[[], float] = time.monotonic,
                   ) -> Callable[[int | None], Progress]:
    """A maker of progress reporters: given a total (None when unknown), a function of the
    bytes so far that says `what: 40% (4.0 of 10.0 MiB, 50.0 MiB/s)` at a tenth passed, at
    most once a second, and at the end."""
    write = out or (lambda line: print(line, file=sys.stderr, flush=True))

    def reporter(total: int | None) -> Progress:
        start, said, last = clock(), [-1], [-_QUIET_S]

        def say(done: int) -> None:
            step = done * 10 // total if total else done // _STEP_UNKNOWN
            end = done == total
            if step <= said[0] or not end and clock() - last[0] < _QUIET_S:
                return
            said[0], last[0] = step, clock()
            of = f" of {_mib(total)}" if total else ""
            pct = f"{done * 100 // total}% " if total else ""
            rate = done / max(clock() - start, 1e-3)
            write(f"{what}: {pct}({_mib(done)}{of}, {_mib(rate)}/s)")

        return say

    return reporter


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"
