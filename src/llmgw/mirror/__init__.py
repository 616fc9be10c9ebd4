"""The model mirror: a bytes server for nodes, a management API, and checked downloads."""

from __future__ import annotations

from llmgw.mirror._disk import DOWNLOADING, FAILED, PRESENT
from llmgw.mirror._errors import MirrorError, MirrorNotFound
from llmgw.mirror._sources import hub_endpoint
from llmgw.mirror.client import MirrorClient

__all__ = [
    "DOWNLOADING",
    "FAILED",
    "PRESENT",
    "MirrorClient",
    "MirrorError",
    "MirrorNotFound",
    "hub_endpoint",
]
