"""Each host's drift as its `llmgw check --serve` last saw it: which promises fail, since when.

Held in memory: a live view that every round refreshes (a restarted control plane has it
back within one interval), not state worth a migration."""

from __future__ import annotations

import re
import threading
import time

from fastapi import FastAPI, HTTPException

from llmgw.contract import AdminPaths
from llmgw.contract.records import DriftReport, HostDrift

_HOST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")


class DriftBoard:
    """Every host's last round, by host name: filled through the admin API (the control
    plane's own machine) and the agent API (a joined node, named by its certificate)."""

    def __init__(self) -> None:
        self._reports: dict[str, HostDrift] = {}
        self._lock = threading.Lock()

    def put(self, host: str, body: DriftReport) -> HostDrift:
        """Keep host's last round, replacing the one before; ValueError for a bad name."""
        if not _HOST.match(host):
            raise ValueError(f"host {host[:80]!r} is not a host name (letters, digits, "
                             "'.', '_', '-')")
        entry: HostDrift = {
            "host": host, "received": time.time(), "checked": body["checked"],
            "promises": body["promises"], "failing": body["failing"],
        }
        with self._lock:
            self._reports[host] = entry
        return entry

    def all(self) -> list[HostDrift]:
        with self._lock:
            return [self._reports[h] for h in sorted(self._reports)]


def add_drift_routes(app: FastAPI, board: DriftBoard) -> None:
    """PUT /api/v1/drift/{host} (a host's last round), GET /api/v1/drift (every host's)."""

    @app.put(AdminPaths.drift("{host}"))
    def report(host: str, body: DriftReport) -> HostDrift:
        """The last round of `llmgw check --serve` on host; replaces the one before."""
        try:
            return board.put(host, body)
        except ValueError as e:
            raise HTTPException(422, str(e)) from None

    @app.get(AdminPaths.DRIFT)
    def drift() -> list[HostDrift]:
        """Every host's last report, by host name."""
        return board.all()
