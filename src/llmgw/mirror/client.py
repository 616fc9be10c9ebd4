"""A client of the mirror's management API, for the harness, the starter step and the agent."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import unquote, urlsplit

import httpx

from llmgw.contract.records import MirrorVersion
from llmgw.httpclient import JSONClient
from llmgw.mirror._disk import DOWNLOADING, PRESENT
from llmgw.mirror._errors import MirrorError, MirrorNotFound

# An upload resumes after this many broken connections in a row before giving up.
UPLOAD_TRIES = 5
# The mirror answers an upload only after it hashed the whole file: give it time.
UPLOAD_READ_TIMEOUT_S = 600.0
_CHUNK = 1 << 20

class MirrorClient(JSONClient):
    """The management API at base_url (http://127.0.0.1:8082 by default). A model version
    comes back as the API sends it, a MirrorVersion (contract.records)."""

    what = "the mirror's management API"
    error = MirrorError
    not_found = MirrorNotFound

    def health(self) -> dict[str, str]:
        return self._call("GET", "/health")

    def fetch(
        self, *, source: str, model: str, version: str, sha256: str | None = None
    ) -> MirrorVersion:
        """Ask the mirror to download source as model/version; joins a download running."""
        body = {"source": source, "model": model, "version": version, "sha256": sha256}
        return self._call("POST", "/api/v1/fetch", json=body)

    def status(self, model: str, version: str) -> MirrorVersion:
        """The model version's status; MirrorNotFound when the mirror does not know it."""
        return self._call("GET", f"/api/v1/models/{model}/{version}")

    def models(self) -> list[MirrorVersion]:
        return self._call("GET", "/api/v1/models")


    def upload(
        self, path: Path, *, model: str, version: str, sha256: str | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> MirrorVersion:
        """Send a local file into the mirror as model/version, streamed; the mirror checks its
        sha256 (computed here unless given) before serving it. An interrupted upload goes on
        from the bytes the mirror kept. Returns the model version once present. progress,
        when given, is called with the bytes of the file sent so far after each chunk."""
        path = Path(path)
        digest = (sha256 or file_sha256(path)).lower()
        size = path.stat().st_size
        for _ in range(UPLOAD_TRIES):
            offset = self._import_offset(model, version, digest)
            if offset is None:
                return self.status(model, version)
            try:
                done = self._put(path, model, version, size, digest, offset, progress=progress)
            except MirrorError as e:
                if e.status is not None:
                    raise
                # The connection broke: an empty PUT says why (a refusal) or that it may go on.
                self._put(path, model, version, size, digest, self._import_offset(
                    model, version, digest) or 0, empty=True)
                continue
            if done["status"]["state"] == PRESENT:
                return done
        raise MirrorError(f"the upload of {path} to {model}/{version} broke {UPLOAD_TRIES} "
                          "times; run it again to go on from where it stopped")

    def fetch_or_import(
        self, *, source: str, model: str, version: str, sha256: str | None = None
    ) -> MirrorVersion:
        """fetch() for a remote source; upload() for file:///PATH, a file on this machine,
        which the mirror itself may not read."""
        if source.startswith("file://"):
            path = Path(unquote(urlsplit(source).path))
            return self.upload(path, model=model, version=version, sha256=sha256)
        return self.fetch(source=source, model=model, version=version, sha256=sha256)

    def _import_offset(self, model: str, version: str, digest: str) -> int | None:
        """Where an upload goes on from: the bytes the mirror kept; None when it has the
        file already; MirrorError when it holds another file under that name."""
        try:
            held = self.status(model, version)["status"]
        except MirrorNotFound:
            return 0
        if held["state"] == PRESENT:
            if held["sha256"] == digest:
                return None
            raise MirrorError(f"the mirror already holds {model}/{version} with sha256 "
                              f"{held['sha256']}, not {digest}; import it under another version",
                              409)
        return held["bytes"] if held["state"] == DOWNLOADING else 0

    def _put(
        self, path: Path, model: str, version: str, size: int, digest: str, offset: int,
        *, empty: bool = False, progress: Callable[[int], None] | None = None,
    ) -> MirrorVersion:
        params = {"size": size, "sha256": digest, "offset": offset}
        body = b"" if empty else _chunks(path, offset, progress)
        timeout = httpx.Timeout(self.timeout, read=max(self.timeout, UPLOAD_READ_TIMEOUT_S))
        return self._call("PUT", f"/api/v1/import/{model}/{version}/{path.name}",
                          params=params, content=body, timeout=timeout)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _chunks(path: Path, offset: int,
            progress: Callable[[int], None] | None = None) -> Iterator[bytes]:
    with path.open("rb") as f:
        f.seek(offset)
        while chunk := f.read(_CHUNK):
            yield chunk
            if progress is not None:
                progress(f.tell())
