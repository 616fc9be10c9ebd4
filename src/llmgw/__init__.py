"""llmgw: bring up, and keep proving, a host that serves LLMs."""

from __future__ import annotations

__version__ = "0.1.0"
