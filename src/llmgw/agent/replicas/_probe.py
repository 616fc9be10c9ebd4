"""What a replica's engine answers over HTTP: its /health, as one of ok, loading, refused or
slow with what was seen, and its requests under way (llama-server's /metrics), waited on
until none are before a retired replica's engine stops."""

from __future__ import annotations

import time

import httpx

# A replica taken off this node: requests the gateway routed just before it left the table
# get this long to arrive, then those under way at most RETIRE_DRAIN_S to finish (the
# gateway's own drain bound), before its engine is stopped.
RETIRE_GRACE_S = 1.0
RETIRE_DRAIN_S = 30.0


def health(http: httpx.Client, endpoint: str, timeout_s: float) -> tuple[str, str]:
    """One probe of GET /health: (ok | loading | refused | slow, what was seen)."""
    url = f"{endpoint}/health"
    try:
        # A fresh connection each time: the probe runs once a heartbeat (5 s), exactly
        # llama-server's keep-alive timeout, so a kept connection can be closed by the
        # engine just as the probe reuses it; and a refusal then means what it says.
        response = http.get(url, timeout=timeout_s, headers={"Connection": "close"})
    except httpx.ConnectError as e:
        return "refused", f"{url} refused the connection: {e}"
    except httpx.HTTPError as e:
        return "slow", f"{url}: {type(e).__name__} {e}".rstrip()
    if response.status_code == 200:
        return "ok", ""
    if response.status_code == 503:
        return "loading", "llama-server is loading the model (503)"
    return "slow", f"{url} answered {response.status_code}"


def requests_under_way(http: httpx.Client, endpoint: str, api_key: str) -> int | None:
    """The requests the engine is processing or has deferred; None when /metrics says not."""
    try:
        response = http.get(f"{endpoint}/metrics", timeout=5.0,
                            headers={"Authorization": f"Bearer {api_key}"})
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    busy = 0
    for line in response.text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("llamacpp:requests_processing", "llamacpp:requests_deferred"):
            busy += int(float(value or 0))
    return busy


def wait_idle(http: httpx.Client, endpoint: str, api_key: str) -> str:
    """Until the engine's slots are idle (llama-server's /metrics), after a grace in which
    requests the gateway routed just before it dropped the replica arrive; what ended it."""
    time.sleep(RETIRE_GRACE_S)
    deadline = time.monotonic() + RETIRE_DRAIN_S
    while time.monotonic() < deadline:
        busy = requests_under_way(http, endpoint, api_key)
        if busy is None:
            return "its load cannot be read (no /metrics)"
        if busy == 0:
            return "its slots are idle"
        time.sleep(0.25)
    return f"still busy after {RETIRE_DRAIN_S:.0f}s"
