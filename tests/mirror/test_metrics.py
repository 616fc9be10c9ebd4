"""The mirror's /metrics on a real `llmgw mirror serve`: bytes served, downloads by state."""

from __future__ import annotations

import hashlib
import os

import httpx

from llmgw.mirror import PRESENT


def metric(text: str, line_start: str) -> float:
    found = [line for line in text.splitlines() if line.startswith(line_start + " ")]
    assert found, f"no {line_start} in:\n{text}"
    return float(found[0].rsplit(" ", 1)[1])


def test_metrics_count_downloads_by_state_and_the_bytes_served(start_mirror, tmp_path) -> None:
    data = os.urandom(100_000)
    src = tmp_path / "w.gguf"
    src.write_bytes(data)
    mirror = start_mirror()
    assert httpx.get(f"{mirror.api_url}/metrics").status_code == 401  # it needs the token
    auth = {"Authorization": f"Bearer {mirror.token}"}
    before = httpx.get(f"{mirror.api_url}/metrics", headers=auth).text
    assert metric(before, 'llmgw_mirror_downloads{state="present"}') == 0
    assert metric(before, "llmgw_mirror_served_bytes_total") == 0
    with mirror.client() as api:
        api.upload(src, model="m", version="v1", sha256=hashlib.sha256(data).hexdigest())
    done = mirror.wait_for("m", "v1", PRESENT)
    assert httpx.get(done.url).content == data
    assert httpx.get(done.url, headers={"Range": "bytes=0-9"}).status_code == 206
    assert httpx.get(done.url + "-nope").status_code == 404
    text = httpx.get(f"{mirror.api_url}/metrics", headers=auth).text
    assert metric(text, 'llmgw_mirror_downloads{state="present"}') == 1
    assert metric(text, "llmgw_mirror_served_bytes_total") == len(data) + 10
    assert metric(text, 'llmgw_mirror_responses_total{status="404"}') == 1
    assert metric(text, 'llmgw_mirror_download_bytes{model="m",version="v1"}') == len(data)
