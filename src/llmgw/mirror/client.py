"""A client of the mirror's management API, for the harness, the starter step and the agent."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmgw._jsonclient import JSONClient
from llmgw.mirror._disk import DOWNLOADING, FAILED, PRESENT
from llmgw.mirror._errors import MirrorError, MirrorNotFound

__all__ = [
    "DOWNLOADING",
    "FAILED",
    "PRESENT",
    "FetchStatus",
    "MirrorClient",
    "MirrorError",
    "MirrorModel",
    "MirrorNotFound",
]


@dataclass(frozen=True)
class FetchStatus:
    """Where a download stands: state is downloading, present or failed."""

    state: str
    bytes: int = 0
    total: int | None = None
    sha256: str | None = None
    err: str = ""

    @property
    def percent(self) -> int | None:
        """Whole percent done, or None while the size is unknown."""
        if self.state == PRESENT:
            return 100
        if not self.total:
            return None
        return min(100, self.bytes * 100 // self.total)


@dataclass(frozen=True)
class MirrorModel:
    """A model version in the mirror: url is where nodes download it from."""

    model: str
    version: str
    url: str
    status: FetchStatus

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MirrorModel:
        s = data["status"]
        status = FetchStatus(
            state=s["state"], bytes=s.get("bytes") or 0, total=s.get("total"),
            sha256=s.get("sha256"), err=s.get("err") or "",
        )
        return cls(data["model"], data["version"], data["url"], status)


class MirrorClient(JSONClient):
    """The management API at base_url (http://127.0.0.1:8082 by default)."""

    what = "the mirror's management API"
    error = MirrorError
    not_found = MirrorNotFound

    def health(self) -> dict[str, Any]:
        return self._call("GET", "/health")

    def fetch(
        self, *, source: str, model: str, version: str, sha256: str | None = None
    ) -> MirrorModel:
        """Ask the mirror to download source as model/version; joins a download running."""
        body = {"source": source, "model": model, "version": version, "sha256": sha256}
        return MirrorModel.from_json(self._call("POST", "/api/v1/fetch", json=body))

    def status(self, model: str, version: str) -> MirrorModel:
        """The model version's status; MirrorNotFound when the mirror does not know it."""
        return MirrorModel.from_json(self._call("GET", f"/api/v1/models/{model}/{version}"))

    def models(self) -> list[MirrorModel]:
        return [MirrorModel.from_json(m) for m in self._call("GET", "/api/v1/models")]

