"""One file's bytes from its source into its partial file: resumed where the partial file
ends, retried while attempts bring new bytes, and hashed as they arrive."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
from tenacity import Retrying, retry_if_exception_type, wait_exponential

from llmgw.contract.records import DownloadStatus
from llmgw.errors import Error
from llmgw.mirror import _sources as sources
from llmgw.mirror._disk import DOWNLOADING, Record
from llmgw.mirror._errors import Forbidden

# A download gives up after this many attempts in a row that brought no new byte.
MAX_STALLS = 8


class Stopped(Error):
    """The mirror is shutting down; the partial file stays for the next start."""


class Interrupted(Error):
    """The connection ended before the whole file came; resume from where it stopped."""


class Download:
    """One model version: its record, the bytes so far, and the thread fetching the rest."""

    def __init__(self, rec: Record, have: int = 0) -> None:
        self.rec = rec
        self.bytes = have
        self.thread: threading.Thread | None = None

    def status(self) -> DownloadStatus:
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


class Transfer:
    """Fetches what a download lacks. check_readable refuses a source the mirror may not
    read; save(dl, **changes) records what the source says of the file (size, validator,
    digest)."""

    def __init__(
        self,
        client: httpx.Client,
        stop: threading.Event,
        sleep: Callable[[float], None],
        check_readable: Callable[[sources.Source], None],
        save: Callable[..., None],
    ) -> None:
        self._client = client
        self._stop = stop
        self._sleep = sleep
        self._check_readable = check_readable
        self._save = save

    def run(self, dl: Download, partial: Path) -> str:
        """The whole file's sha256, once every byte is in partial."""
        partial.parent.mkdir(parents=True, exist_ok=True)
        hasher = hash_of(partial, dl)
        stalls = [0]

        def attempt() -> None:
            before = dl.bytes
            try:
                self._fetch_rest(dl, partial, hasher)
            except Interrupted:
                stalls[0] = 0 if dl.bytes > before else stalls[0] + 1
                raise

        retrying = Retrying(
            stop=lambda _state: stalls[0] >= MAX_STALLS or self._stop.is_set(),
            wait=wait_exponential(multiplier=0.2, max=10),
            retry=retry_if_exception_type(Interrupted),
            sleep=self._sleep,
            reraise=True,
        )
        retrying(attempt)
        return hasher.hexdigest()

    def _fetch_rest(self, dl: Download, partial: Path, hasher: Digest) -> None:
        source = sources.parse(dl.rec.source)
        try:
            self._check_readable(source)  # again: a link may have moved since the fetch
        except Forbidden as e:
            raise sources.Gone(str(e)) from e
        try:
            opened = sources.open_at(source, dl.bytes, dl.rec.validator, self._client)
        except sources.Changed:
            _restart(dl, partial, hasher)
            raise Interrupted from None
        except (httpx.TransportError, sources.Unavailable) as e:
            raise Interrupted(str(e)) from e
        with opened:
            if opened.start != dl.bytes:
                _restart(dl, partial, hasher)
            if (opened.total, opened.validator) != (dl.rec.total, dl.rec.validator):
                self._save(dl, total=opened.total, validator=opened.validator)
            if opened.digest and not dl.rec.expected_sha256:
                self._save(dl, expected_sha256=opened.digest)
            self._copy(opened, dl, partial, hasher)

    def _copy(self, opened: sources.Opened, dl: Download, partial: Path, hasher: Digest) -> None:
        with partial.open("ab") as out:
            try:
                for chunk in opened.chunks:
                    if self._stop.is_set():
                        raise Stopped
                    out.write(chunk)
                    hasher.update(chunk)
                    dl.bytes += len(chunk)
            except (httpx.TransportError, httpx.StreamError) as e:
                raise Interrupted(str(e)) from e
            finally:
                out.flush()
                os.fsync(out.fileno())
        if dl.rec.total is not None and dl.bytes < dl.rec.total:
            raise Interrupted(f"the source closed at byte {dl.bytes} of {dl.rec.total}")


class Digest:
    """A sha256 that can start over (hashlib's objects cannot be reset)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._h = hashlib.sha256()

    def update(self, data: bytes) -> None:
        self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def hash_of(partial: Path, dl: Download) -> Digest:
    """The sha256 of what a previous attempt left, so a resumed download is checked whole."""
    hasher = Digest()
    if not partial.is_file():
        dl.bytes = 0
        return hasher
    with partial.open("rb") as f:
        while chunk := f.read(sources.CHUNK):
            hasher.update(chunk)
    dl.bytes = partial.stat().st_size
    return hasher


def _restart(dl: Download, partial: Path, hasher: Digest) -> None:
    # The source changed or ignored the range: what we have cannot be continued.
    partial.unlink(missing_ok=True)
    dl.bytes = 0
    hasher.reset()
