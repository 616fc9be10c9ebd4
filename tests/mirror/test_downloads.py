"""Downloads into a real `llmgw mirror serve` from real upstream servers on loopback."""

from __future__ import annotations

import hashlib
import os
import signal
import threading

import httpx
import pytest

from llmgw.mirror import FAILED, PRESENT, MirrorNotFound
from tests.mirror.upstream import Upstream

SIZE = 4 * 1024 * 1024 + 123  # not a multiple of any chunk size


@pytest.fixture(scope="module")
def data() -> bytes:
    return os.urandom(SIZE)


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def test_a_dropped_connection_is_resumed_and_fetches_the_file_about_once(start_mirror, data):
    """The upstream drops the first connection halfway; the mirror resumes with a Range,
    ends present with the right digest, and the upstream sent about the file's size once."""
    mirror = start_mirror()
    with Upstream(data, drop_at=SIZE // 2) as up, mirror.client() as api:
        api.fetch(source=up.url, model="m", version="v1", sha256=sha(data))
        done = mirror.wait_for("m", "v1", PRESENT)
        assert done["status"]["sha256"] == sha(data)
        assert len(up.requests) == 2 and up.requests[0] is None, up.requests
        resumed_at = int(up.requests[1].removeprefix("bytes=").removesuffix("-"))
        assert 0 < resumed_at <= SIZE // 2, up.requests
        assert SIZE <= up.sent < SIZE * 1.05, f"upstream sent {up.sent} bytes for {SIZE}"
    assert sha(httpx.get(done["url"]).content) == sha(data)


def test_corrupted_bytes_fail_naming_both_digests_and_nothing_is_served(start_mirror, data):
    """An upstream serving corrupted bytes: failed, both digests in err, the URL is 404,
    and no file is left under its final name."""
    mirror = start_mirror()
    with Upstream(data, corrupt=True) as up, mirror.client() as api:
        api.fetch(source=up.url, model="m", version="v1", sha256=sha(data))
        failed = mirror.wait_for("m", "v1", FAILED)
        assert sha(data) in failed["status"]["err"] and sha(up.body()) in failed["status"]["err"]
    assert httpx.get(failed["url"]).status_code == 404
    assert not (mirror.dir / "m" / "v1" / "model.gguf").exists()


def test_a_digest_the_source_states_is_checked(start_mirror, data):
    """With no sha256 in the fetch, the one the source states (X-Linked-Etag, as the hub
    does) is checked: corrupted bytes fail; the negative control with good bytes is present."""
    mirror = start_mirror()
    stated = {"X-Linked-Etag": f'"{sha(data)}"'}
    with Upstream(data, corrupt=True, headers=stated) as bad, mirror.client() as api:
        api.fetch(source=bad.url, model="m", version="bad")
        failed = mirror.wait_for("m", "bad", FAILED)
        assert sha(data) in failed["status"]["err"]
    with Upstream(data, headers=stated) as good, mirror.client() as api:
        api.fetch(source=good.url, model="m", version="good")
        assert mirror.wait_for("m", "good", PRESENT)["status"]["sha256"] == sha(data)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "crash"])
def test_a_download_resumes_after_the_mirror_restarts(start_mirror, data, sig):
    """The mirror stops mid-download (cleanly or killed); started again on the same dir it
    resumes from its partial file and ends present, the upstream sending about one file."""
    first = start_mirror()
    with Upstream(data, delay_per_chunk_s=0.03) as up:
        with first.client() as api:
            api.fetch(source=up.url, model="m", version="v1", sha256=sha(data))
        _wait_bytes(first, SIZE // 4)
        rc = first.stop(sig)
        if sig == signal.SIGTERM:
            assert rc == 0, first.log()
        up.behaviour.delay_per_chunk_s = 0.0
        second = start_mirror(first.dir, ports=(first.bytes_port, first.api_port))
        done = second.wait_for("m", "v1", PRESENT)
        assert done["status"]["sha256"] == sha(data)
        assert up.requests[-1] and up.requests[-1].startswith("bytes="), up.requests
        assert up.sent < SIZE * 1.25, f"upstream sent {up.sent} bytes for {SIZE}"
    assert sha(httpx.get(done["url"]).content) == sha(data)


def _wait_bytes(mirror, at_least: int) -> None:
    from llmgw.host.waiting import Probe, wait_until

    def look() -> Probe:
        with mirror.client() as api:
            st = api.status("m", "v1")["status"]
        return Probe(st["bytes"] >= at_least, repr(st))

    wait_until(f"{at_least} bytes downloaded", look, timeout_s=30, interval_s=0.05)


def test_status_reports_progress_and_a_second_fetch_joins(start_mirror, data):
    """While downloading, status has bytes, total and a percent; a second fetch of the same
    model version joins the running download: the upstream sees one request."""
    mirror = start_mirror()
    with Upstream(data, delay_per_chunk_s=0.01) as up, mirror.client() as api:
        api.fetch(source=up.url, model="m", version="v1")
        _wait_bytes(mirror, 1)
        joined = api.fetch(source=up.url, model="m", version="v1")
        assert joined["status"]["state"] == "downloading"
        st = api.status("m", "v1")["status"]
        assert st["total"] == SIZE and 0 < st["bytes"] < SIZE, st
        assert 0 <= (st["percent"] or 0) < 100, st
        mirror.wait_for("m", "v1", PRESENT)
        assert len(up.requests) == 1, up.requests


def test_present_models_survive_a_restart(start_mirror, tmp_path, data):
    """A present model is present after a restart (derived from disk) and still served."""
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    first = start_mirror()
    with first.client() as api:
        api.upload(src, model="m", version="v1")
    before = first.wait_for("m", "v1", PRESENT)
    first.stop()
    second = start_mirror(first.dir, ports=(first.bytes_port, first.api_port))
    with second.client() as api:
        after = api.status("m", "v1")
    assert after == before
    assert sha(httpx.get(after["url"]).content) == sha(data)


def test_unknown_models_are_not_found_and_bad_requests_say_why(start_mirror):
    """404 is MirrorNotFound; an unknown source scheme or a path-like model name is refused."""
    mirror = start_mirror()
    with mirror.client() as api:
        with pytest.raises(MirrorNotFound):
            api.status("nope", "v1")
        with pytest.raises(Exception, match="scheme the mirror does not know"):
            api.fetch(source="ftp://x/y.gguf", model="m", version="v1")
        with pytest.raises(Exception, match="422"):
            api.fetch(source="file:///etc/hostname", model="..", version="v1")


def test_concurrent_fetches_start_one_download(start_mirror, data):
    """Many fetches of one model version at once start one download (one upstream GET)."""
    mirror = start_mirror()
    with Upstream(data, delay_per_chunk_s=0.005) as up:
        def fetch() -> None:
            with mirror.client() as api:
                api.fetch(source=up.url, model="m", version="v1")

        threads = [threading.Thread(target=fetch) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        mirror.wait_for("m", "v1", PRESENT)
        assert len(up.requests) == 1, up.requests


def test_a_source_busy_for_a_while_is_retried(start_mirror, data):
    """503 twice, then the file: the mirror retries and ends present."""
    mirror = start_mirror()
    with Upstream(data, unavailable_first=2) as up, mirror.client() as api:
        api.fetch(source=up.url, model="m", version="v1", sha256=sha(data))
        assert mirror.wait_for("m", "v1", PRESENT)["status"]["sha256"] == sha(data)
        assert len(up.requests) == 3, up.requests


def test_a_missing_source_fails_at_once_saying_so(start_mirror, data):
    """404 from the source is not retried: failed, naming the source and the status."""
    mirror = start_mirror()
    with Upstream(data) as up, mirror.client() as api:
        missing = up.url + ".nope"
        api.fetch(source=missing, model="m", version="v1")
        failed = mirror.wait_for("m", "v1", FAILED)
        assert missing in failed["status"]["err"] and "404" in failed["status"]["err"]


def test_a_failed_download_names_its_source_and_hub_without_their_passwords(
        start_mirror, data, monkeypatch):
    """A source and an HF_ENDPOINT that carry `user:password@`, both answering 404: each
    err and the mirror's log name the host, port and path (the control: the URL is said),
    never the user or the password."""
    with Upstream(data) as up:
        where = up.url.removeprefix("http://")
        monkeypatch.setenv("HF_ENDPOINT", f"http://hubuser:hub-s3cret@{where.split('/')[0]}")
        mirror = start_mirror()
        with mirror.client() as api:
            api.fetch(source=f"http://srcuser:src-s3cret@{where}.nope", model="m", version="v1")
            api.fetch(source="hf:org/repo/model.gguf", model="m", version="v2")
            errs = [mirror.wait_for("m", v, FAILED)["status"]["err"] for v in ("v1", "v2")]
    assert f"cannot download {up.url}.nope: {up.url}.nope answered 404" in errs[0], errs
    hub = f"http://{where.split('/')[0]}/org/repo/resolve/main/model.gguf"
    assert f"{hub} answered 404" in errs[1], errs
    said = "\n".join([*errs, mirror.log()])
    for secret in ("srcuser", "src-s3cret", "hubuser", "hub-s3cret"):
        assert secret not in said, said
