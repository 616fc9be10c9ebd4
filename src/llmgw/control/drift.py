"""Each host's drift as its `llmgw check --serve` last saw it: which promises fail, since when.

Held in memory: a live view that every round refreshes (a restarted control plane has it
back within one interval), not state worth a migration."""

from __future__ import annotations

import re
import threading
import time

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field

from llmgw.contract import AdminPaths
from llmgw.contract.records import HostDrift

_HOST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")


class Failing(BaseModel):
    promise: str = Field(max_length=200)
    since: float
    message: str = Field("", max_length=4000)


class Report(BaseModel):
    checked: float
    promises: int = Field(ge=0)
    failing: list[Failing] = Field(default_factory=list, max_length=1000)


def add_drift_routes(app: FastAPI) -> None:
    """PUT /api/v1/drift/{host} (a host's last round), GET /api/v1/drift (every host's)."""
    reports: dict[str, HostDrift] = {}
    lock = threading.Lock()

    @app.put(AdminPaths.drift("{host}"))
    def report(host: str, body: Report) -> HostDrift:
        """The last round of `llmgw check --serve` on host; replaces the one before."""
        if not _HOST.match(host):
            raise HTTPException(422, f"host {host[:80]!r} is not a host name (letters, digits, "
                                     "'.', '_', '-')")
        entry: HostDrift = {"host": host, "received": time.time(), **body.model_dump()}  # type: ignore[typeddict-item]
        with lock:
            reports[host] = entry
        return entry

    @app.get(AdminPaths.DRIFT)
    def drift() -> list[HostDrift]:
        """Every host's last report, by host name."""
        with lock:
            return [reports[h] for h in sorted(reports)]
