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


def _metrics(mirror) -> str:  # type: ignore[no-untyped-def]
    """/metrics with the admin token (every management path but /health needs it)."""
    return httpx.get(f"{mirror.api_url}/metrics",
                     headers={"Authorization": f"Bearer {mirror.token}"}).text


def test_metrics_count_downloads_by_state_and_the_bytes_served(start_mirror, tmp_path) -> None:
    data = os.urandom(100_000)
    src = tmp_path / "w.gguf"
    src.write_bytes(data)
    mirror = start_mirror(import_dirs=(tmp_path,))
    assert httpx.get(f"{mirror.api_url}/metrics").status_code == 401  # it needs the token
    before = _metrics(mirror)
    assert metric(before, 'llmgw_mirror_downloads{state="present"}') == 0
    assert metric(before, "llmgw_mirror_served_bytes_total") == 0
    with mirror.client() as api:
        api.fetch(source=src.as_uri(), model="m", version="v1",
                  sha256=hashlib.sha256(data).hexdigest())
    done = mirror.wait_for("m", "v1", PRESENT)
    assert httpx.get(done["url"]).content == data
    assert httpx.get(done["url"], headers={"Range": "bytes=0-9"}).status_code == 206
    assert httpx.get(done["url"] + "-nope").status_code == 404
    text = _metrics(mirror)
    assert metric(text, 'llmgw_mirror_downloads{state="present"}') == 1
    assert metric(text, "llmgw_mirror_served_bytes_total") == len(data) + 10
    assert metric(text, 'llmgw_mirror_responses_total{status="404"}') == 1
    assert metric(text, 'llmgw_mirror_download_bytes{model="m",version="v1"}') == len(data)


def test_the_disk_holding_the_models_dir_is_exported_as_statvfs_says(start_mirror) -> None:
    """Size and free bytes of the models dir's filesystem (what the disk alert divides);
    free is what an unprivileged writer has left (f_bavail), so it moves with other writers
    and is compared within 64 MiB. A dir that cannot be read gives no family."""
    from llmgw.mirror._metrics import disk_families

    mirror = start_mirror()
    text = _metrics(mirror)
    st = os.statvfs(mirror.dir)
    assert metric(text, "llmgw_mirror_disk_size_bytes") == st.f_blocks * st.f_frsize
    free = metric(text, "llmgw_mirror_disk_free_bytes")
    assert abs(free - st.f_bavail * st.f_frsize) < 64 << 20
    assert 0 < free <= metric(text, "llmgw_mirror_disk_size_bytes")
    assert list(disk_families(mirror.dir / "no-such-dir")) == []
