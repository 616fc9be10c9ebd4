"""The model versions the mirror holds, one download or import each: recorded on disk,
checked against sha256, then renamed into place. Bringing a source's bytes is _transfer.py's."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any
from urllib.parse import unquote, urlsplit

import httpx

from llmgw import httpclient
from llmgw.contract.records import MirrorVersion
from llmgw.errors import shown_url
from llmgw.mirror import _sources as sources
from llmgw.mirror._disk import DOWNLOADING, FAILED, PRESENT, Disk, Record
from llmgw.mirror._errors import Forbidden, MirrorError
from llmgw.mirror._transfer import MAX_STALLS, Download, Interrupted, Stopped, Transfer, hash_of

log = logging.getLogger("llmgw.mirror")

# The source recorded for a file uploaded through the API (`llmgw mirror import`).
IMPORT_PREFIX = "import:"


class Conflict(MirrorError):
    """A fetch disagrees with what the mirror already holds or is downloading."""


class WrongOffset(Conflict):
    """An import continues at a byte other than the one the mirror holds up to."""

    def __init__(self, message: str, have: int) -> None:
        super().__init__(message, 409)
        self.have = have


@dataclass(frozen=True)
class Servable:
    """A finished, checked file the bytes server may send."""

    path: Path
    sha256: str


class Manager:
    """Every model version the mirror knows, loaded from disk at start and kept current."""

    def __init__(
        self,
        root: Path,
        base_url: str,
        *,
        client: httpx.Client | None = None,
        sleep: Callable[[float], None] = time.sleep,
        import_dirs: Sequence[Path] = (),
    ) -> None:
        self.disk = Disk(root)
        self.base_url = base_url.rstrip("/")
        # The only folders a file:// source may be read from (the mirror may run as root).
        self.import_dirs = tuple(Path(d).resolve() for d in import_dirs)
        self._receiving: set[tuple[str, str]] = set()
        self._client = client or httpclient.client(
            follow_redirects=True, timeout=httpx.Timeout(30.0, connect=10.0)
        )
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._transfer = Transfer(self._client, self._stop, sleep, self.check_readable,
                                  self._set)
        self._downloads: dict[tuple[str, str], Download] = {}

    # --- life ---

    def start(self) -> None:
        """Read the models dir; resume every download a previous run left unfinished."""
        self.disk.root.mkdir(parents=True, exist_ok=True)
        for rec in self.disk.records():
            dl = self._from_disk(rec)
            self._downloads[(rec.model, rec.version)] = dl
            # An unfinished import waits for its client to send the rest.
            if rec.state == DOWNLOADING and not rec.source.startswith(IMPORT_PREFIX):
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

    def view(self, model: str, version: str) -> MirrorVersion | None:
        with self._lock:
            dl = self._downloads.get((model, version))
            if dl is None:
                return None
            return {"model": model, "version": version, "url": self.url(dl.rec),
                    "status": dl.status()}

    def views(self) -> list[MirrorVersion]:
        with self._lock:
            keys = sorted(self._downloads)
        return [v for m, ver in keys if (v := self.view(m, ver))]

    def servable(self, model: str, version: str, file: str) -> Servable | None:
        """The file at <model>/<version>/<file> when present and checked; else None."""
        dl = self._downloads.get((model, version))
        if dl is None or dl.rec.state != PRESENT or dl.rec.file != file or not dl.rec.sha256:
            return None
        return Servable(self.disk.final(dl.rec), dl.rec.sha256)

    def fetch(self, spec: str, model: str, version: str, sha256: str | None) -> MirrorVersion:
        """Start a download, or join the one running, or answer for the file already here."""
        source = sources.parse(spec)
        self.check_readable(source)
        with self._lock:
            dl = self._downloads.get((model, version))
            if dl is not None and dl.rec.state != FAILED:
                _agree(dl.rec, source, sha256)
            else:
                dl = self._new(source, model, version, sha256, dl)
        view = self.view(model, version)
        assert view is not None
        return view

    def check_readable(self, source: sources.Source) -> None:
        """Forbidden unless a file:// source lies inside an import dir (links resolved)."""
        if not source.url.startswith("file://"):
            return
        path = Path(unquote(urlsplit(source.url).path)).resolve()
        if any(path.is_relative_to(d) for d in self.import_dirs):
            return
        dirs = ", ".join(map(str, self.import_dirs)) or "none"
        raise Forbidden(
            f"the mirror reads file:// sources only inside its import dirs ({dirs}), and "
            f"{path} is not in one; upload the file with `llmgw mirror import FILE --model M "
            "--version V`, or start the mirror with --import-dir DIR", 403,
        )

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

    # --- imports: a file sent through the API, resumable like a download ---

    def begin_import(
        self, model: str, version: str, file: str, size: int, sha256: str, offset: int
    ) -> Download | None:
        """Claim model/version for an upload that continues at offset; None when the same
        file is already present. Conflict when it disagrees with what the mirror holds."""
        wanted = Record(model, version, IMPORT_PREFIX + file, file, expected_sha256=sha256,
                        total=size)
        key = (model, version)
        with self._lock:
            if key in self._receiving:
                raise Conflict(f"{model}/{version} is being imported by another client; "
                               "wait for it to end", 409)
            dl = self._downloads.get(key)
            if dl is not None and dl.rec.state != FAILED:
                _agree_import(dl.rec, wanted)
                if dl.rec.state == PRESENT:
                    return None
            else:
                self.disk.partial(wanted).unlink(missing_ok=True)
                self.disk.save(wanted)
                dl = self._downloads[key] = Download(wanted, 0)
            if offset != dl.bytes:
                raise WrongOffset(
                    f"the mirror holds the first {dl.bytes} bytes of {model}/{version}; "
                    f"continue from byte {dl.bytes}, not {offset}", dl.bytes,
                )
            self._receiving.add(key)
        return dl

    def import_file(self, dl: Download) -> IO[bytes]:
        partial = self.disk.partial(dl.rec)
        partial.parent.mkdir(parents=True, exist_ok=True)
        return partial.open("ab")

    def receive(self, dl: Download, out: IO[bytes], chunk: bytes) -> None:
        """Append one chunk of an import; Conflict past the size it announced."""
        total = dl.rec.total or 0
        if dl.bytes + len(chunk) > total:
            raise Conflict(f"the import of {dl.rec.model}/{dl.rec.version} sent more than "
                           f"the {total} bytes it announced; nothing past them is kept", 413)
        out.write(chunk)
        dl.bytes += len(chunk)

    def end_import(self, dl: Download) -> Record:
        """Make what came durable; when the file is whole, check its sha256 and serve it."""
        partial = self.disk.partial(dl.rec)
        try:
            with partial.open("rb") as f:
                os.fsync(f.fileno())
            if dl.bytes == dl.rec.total:
                self._finish(dl, hash_of(partial, dl).hexdigest())
        except (MirrorError, OSError) as e:
            self._set(dl, state=FAILED, err=str(e))
        finally:
            with self._lock:
                self._receiving.discard((dl.rec.model, dl.rec.version))
        return dl.rec

    # --- the download itself, on its own thread ---

    def _spawn(self, dl: Download) -> None:
        name = f"fetch {dl.rec.model}/{dl.rec.version}"
        dl.thread = threading.Thread(target=self._run, args=(dl,), name=name, daemon=True)
        dl.thread.start()

    def _run(self, dl: Download) -> None:
        try:
            sha256 = self._transfer.run(dl, self.disk.partial(dl.rec))
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

    def _finish(self, dl: Download, sha256: str) -> None:
        rec, partial = dl.rec, self.disk.partial(dl.rec)
        if rec.expected_sha256 and sha256 != rec.expected_sha256:
            partial.unlink(missing_ok=True)
            dl.bytes = 0
            raise MirrorError(
                f"the download of {shown_url(rec.source)} has sha256 {sha256}, but "
                f"{rec.expected_sha256} was expected; it was discarded and is not served. "
                "Check the source and the sha256, then fetch again"
            )
        os.replace(partial, self.disk.final(rec))
        self._set(dl, state=PRESENT, sha256=sha256, total=dl.bytes, err="")
        log.info("%s/%s present: %d bytes, sha256 %s", rec.model, rec.version, dl.bytes, sha256)


def _agree(rec: Record, source: sources.Source, sha256: str | None) -> None:
    if rec.source != source.spec:
        raise Conflict(
            f"{rec.model}/{rec.version} is already {rec.state} from {shown_url(rec.source)}, "
            f"not {shown_url(source.spec)}; fetch under another version to keep both"
        )
    held = rec.sha256 or rec.expected_sha256
    if sha256 and held and sha256 != held:
        raise Conflict(
            f"{rec.model}/{rec.version} is {rec.state} with sha256 {held}, not {sha256}; "
            "fetch under another version, or check the digest"
        )


def _agree_import(held: Record, wanted: Record) -> None:
    if (held.source, held.total, held.expected_sha256 or held.sha256) != (
        wanted.source, wanted.total, wanted.expected_sha256
    ):
        raise Conflict(
            f"{held.model}/{held.version} is already {held.state} from "
            f"{shown_url(held.source)} "
            f"({held.total} bytes, sha256 {held.sha256 or held.expected_sha256}), not "
            f"{shown_url(wanted.source)} ({wanted.total} bytes, sha256 {wanted.expected_sha256}); "
            "import it under another version to keep both", 409,
        )


def _reason(rec: Record, e: Exception) -> str:
    """Why rec's download failed, as the API shows it and the log says it: its source by
    shown_url (an https:// source may carry a password)."""
    source = shown_url(rec.source)
    if isinstance(e, MirrorError):
        return str(e)
    if isinstance(e, sources.Gone):
        return f"cannot download {source}: {e}; check the source, then fetch again"
    if isinstance(e, Interrupted):
        return (
            f"the download of {source} stopped {MAX_STALLS} times without progress "
            f"(last: {e}); fetch again to resume from where it stopped"
        )
    return f"the download of {source} failed: {type(e).__name__}: {e}; fetch again"
