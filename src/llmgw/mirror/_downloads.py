"""Downloads into the models dir: one per model version, resumed, checked, then renamed."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
from tenacity import Retrying, retry_if_exception_type, wait_exponential

from llmgw.mirror import _sources as sources
from llmgw.mirror._disk import DOWNLOADING, FAILED, PRESENT, Disk, Record
from llmgw.mirror._errors import MirrorError

log = logging.getLogger("llmgw.mirror")

# A download gives up after this many attempts in a row that brought no new byte.
MAX_STALLS = 8


class Conflict(MirrorError):
    """A fetch disagrees with what the mirror already holds or is downloading."""


class Stopped(Exception):
    """The mirror is shutting down; the partial file stays for the next start."""


class _Interrupted(Exception):
    """The connection ended before the whole file came; resume from where it stopped."""


@dataclass(frozen=True)
class Servable:
    """A finished, checked file the bytes server may send."""

    path: Path
    sha256: str


class Download:
    """One model version: its record, the bytes so far, and the thread fetching the rest."""

    def __init__(self, rec: Record, have: int = 0) -> None:
        self.rec = rec
        self.bytes = have
        self.thread: threading.Thread | None = None

    def status(self) -> dict[str, Any]:
        rec = self.rec
        total = rec.total
        percent = None
        if rec.state == DOWNLOADING and total:
            percent = min(100, self.bytes * 100 // total)
        return {
            "state": rec.state,
            "bytes": self.bytes,
            "total": total,
            "sha256": rec.sha256 or rec.expected_sha256,
            "err": rec.err,
            "percent": percent,
        }


class Manager:
    """Every model version the mirror knows, loaded from disk at start and kept current."""

    def __init__(
        self,
        root: Path,
        base_url: str,
        *,
        client: httpx.Client | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.disk = Disk(root)
        self.base_url = base_url.rstrip("/")
        self._client = client or httpx.Client(
            follow_redirects=True, timeout=httpx.Timeout(30.0, connect=10.0)
        )
        self._sleep = sleep
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._downloads: dict[tuple[str, str], Download] = {}

    # --- life ---

    def start(self) -> None:
        """Read the models dir; resume every download a previous run left unfinished."""
        self.disk.root.mkdir(parents=True, exist_ok=True)
        for rec in self.disk.records():
            dl = self._from_disk(rec)
            self._downloads[(rec.model, rec.version)] = dl
            if rec.state == DOWNLOADING:
                self._spawn(dl)

    def _from_disk(self, rec: Record) -> Download:
        final, partial = self.disk.final(rec), self.disk.partial(rec)
        if rec.state == PRESENT:
            if final.is_file() and final.stat().st_size == rec.total:
                return Download(rec, rec.total or 0)
            rec = replace(rec, state=FAILED, err=(
                f"{final} is missing or its size changed since it was checked; "
                "fetch it again"
            ))
        have = partial.stat().st_size if partial.is_file() else 0
        return Download(rec, have)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop every download; their partial files and records stay to resume next start."""
        self._stop.set()
        for dl in list(self._downloads.values()):
            if dl.thread is not None:
                dl.thread.join(timeout_s)
        self._client.close()

    # --- what the API and the bytes server ask ---

    def url(self, rec: Record) -> str:
        return f"{self.base_url}/{rec.model}/{rec.version}/{rec.file}"

    def view(self, model: str, version: str) -> dict[str, Any] | None:
        with self._lock:
            dl = self._downloads.get((model, version))
            if dl is None:
                return None
            return {"model": model, "version": version, "url": self.url(dl.rec),
                    "status": dl.status()}

    def views(self) -> list[dict[str, Any]]:
        with self._lock:
            keys = sorted(self._downloads)
        return [v for m, ver in keys if (v := self.view(m, ver))]

    def servable(self, model: str, version: str, file: str) -> Servable | None:
        """The file at <model>/<version>/<file> when present and checked; else None."""
        dl = self._downloads.get((model, version))
        if dl is None or dl.rec.state != PRESENT or dl.rec.file != file or not dl.rec.sha256:
            return None
        return Servable(self.disk.final(dl.rec), dl.rec.sha256)

    def fetch(self, spec: str, model: str, version: str, sha256: str | None) -> dict[str, Any]:
        """Start a download, or join the one running, or answer for the file already here."""
        source = sources.parse(spec)
        with self._lock:
            dl = self._downloads.get((model, version))
            if dl is not None and dl.rec.state != FAILED:
                _agree(dl.rec, source, sha256)
            else:
                dl = self._new(source, model, version, sha256, dl)
        view = self.view(model, version)
        assert view is not None
        return view

    def _new(
        self, source: sources.Source, model: str, version: str, sha256: str | None,
        old: Download | None,
    ) -> Download:
        rec = Record(model, version, source.spec, source.file_name, expected_sha256=sha256)
        have = 0
        if old is not None and (old.rec.source, old.rec.file) == (source.spec, source.file_name):
            rec.validator, rec.total = old.rec.validator, old.rec.total
            have = old.bytes
        else:
            self.disk.partial(rec).unlink(missing_ok=True)
        self.disk.save(rec)
        dl = Download(rec, have)
        self._downloads[(model, version)] = dl
        self._spawn(dl)
        return dl

    # --- the download itself, on its own thread ---

    def _spawn(self, dl: Download) -> None:
        name = f"fetch {dl.rec.model}/{dl.rec.version}"
        dl.thread = threading.Thread(target=self._run, args=(dl,), name=name, daemon=True)
        dl.thread.start()

    def _run(self, dl: Download) -> None:
        try:
            sha256 = self._download(dl)
            self._finish(dl, sha256)
        except Stopped:
            log.info("stopped %s/%s at byte %d", dl.rec.model, dl.rec.version, dl.bytes)
        except Exception as e:  # noqa: BLE001 - any failure ends in a `failed` state, said why
            if self._stop.is_set():
                return  # shutting down mid-retry: the record still says downloading; resumed
            log.warning("%s/%s failed: %s", dl.rec.model, dl.rec.version, e)
            self._set(dl, state=FAILED, err=_reason(dl.rec, e))

    def _set(self, dl: Download, **changes: Any) -> None:
        with self._lock:
            dl.rec = replace(dl.rec, **changes)
            self.disk.save(dl.rec)

    def _download(self, dl: Download) -> str:
        partial = self.disk.partial(dl.rec)
        partial.parent.mkdir(parents=True, exist_ok=True)
        hasher = _hash_of(partial, dl)
        stalls = [0]

        def attempt() -> None:
            before = dl.bytes
            try:
                self._fetch_rest(dl, partial, hasher)
            except _Interrupted:
                stalls[0] = 0 if dl.bytes > before else stalls[0] + 1
                raise

        retrying = Retrying(
            stop=lambda _state: stalls[0] >= MAX_STALLS or self._stop.is_set(),
            wait=wait_exponential(multiplier=0.2, max=10),
            retry=retry_if_exception_type(_Interrupted),
            sleep=self._sleep,
            reraise=True,
        )
        retrying(attempt)
        return hasher.hexdigest()

    def _fetch_rest(self, dl: Download, partial: Path, hasher: _Digest) -> None:
        source = sources.parse(dl.rec.source)
        try:
            opened = sources.open_at(source, dl.bytes, dl.rec.validator, self._client)
        except sources.Changed:
            _restart(dl, partial, hasher)
            raise _Interrupted from None
        except (httpx.TransportError, sources.Unavailable) as e:
            raise _Interrupted(str(e)) from e
        with opened:
            if opened.start != dl.bytes:
                _restart(dl, partial, hasher)
            if (opened.total, opened.validator) != (dl.rec.total, dl.rec.validator):
                self._set(dl, total=opened.total, validator=opened.validator)
            if opened.digest and not dl.rec.expected_sha256:
                self._set(dl, expected_sha256=opened.digest)
            self._copy(opened, dl, partial, hasher)

    def _copy(self, opened: sources.Opened, dl: Download, partial: Path, hasher: _Digest) -> None:
        with partial.open("ab") as out:
            try:
                for chunk in opened.chunks:
                    if self._stop.is_set():
                        raise Stopped
                    out.write(chunk)
                    hasher.update(chunk)
                    dl.bytes += len(chunk)
            except (httpx.TransportError, httpx.StreamError) as e:
                raise _Interrupted(str(e)) from e
            finally:
                out.flush()
                os.fsync(out.fileno())
        if dl.rec.total is not None and dl.bytes < dl.rec.total:
            raise _Interrupted(f"the source closed at byte {dl.bytes} of {dl.rec.total}")

    def _finish(self, dl: Download, sha256: str) -> None:
        rec, partial = dl.rec, self.disk.partial(dl.rec)
        if rec.expected_sha256 and sha256 != rec.expected_sha256:
            partial.unlink(missing_ok=True)
            dl.bytes = 0
            raise MirrorError(
                f"the download of {rec.source} has sha256 {sha256}, but {rec.expected_sha256} "
                "was expected; it was discarded and is not served. Check the source and the "
                "sha256, then fetch again"
            )
        os.replace(partial, self.disk.final(rec))
        self._set(dl, state=PRESENT, sha256=sha256, total=dl.bytes, err="")
        log.info("%s/%s present: %d bytes, sha256 %s", rec.model, rec.version, dl.bytes, sha256)


def _agree(rec: Record, source: sources.Source, sha256: str | None) -> None:
    if rec.source != source.spec:
        raise Conflict(
            f"{rec.model}/{rec.version} is already {rec.state} from {rec.source}, not "
            f"{source.spec}; fetch under another version to keep both"
        )
    held = rec.sha256 or rec.expected_sha256
    if sha256 and held and sha256 != held:
        raise Conflict(
            f"{rec.model}/{rec.version} is {rec.state} with sha256 {held}, not {sha256}; "
            "fetch under another version, or check the digest"
        )


class _Digest:
    """A sha256 that can start over (hashlib's objects cannot be reset)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._h = hashlib.sha256()

    def update(self, data: bytes) -> None:
        self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def _hash_of(partial: Path, dl: Download) -> _Digest:
    """The sha256 of what a previous attempt left, so a resumed download is checked whole."""
    hasher = _Digest()
    if not partial.is_file():
        dl.bytes = 0
        return hasher
    with partial.open("rb") as f:
        while chunk := f.read(sources.CHUNK):
            hasher.update(chunk)
    dl.bytes = partial.stat().st_size
    return hasher


def _restart(dl: Download, partial: Path, hasher: _Digest) -> None:
    # The source changed or ignored the range: what we have cannot be continued.
    partial.unlink(missing_ok=True)
    dl.bytes = 0
    hasher.reset()


def _reason(rec: Record, e: Exception) -> str:
    if isinstance(e, MirrorError):
        return str(e)
    if isinstance(e, sources.Gone):
        return f"cannot download {rec.source}: {e}; check the source, then fetch again"
    if isinstance(e, _Interrupted):
        return (
            f"the download of {rec.source} stopped {MAX_STALLS} times without progress "
            f"(last: {e}); fetch again to resume from where it stopped"
        )
    return f"the download of {rec.source} failed: {type(e).__name__}: {e}; fetch again"
