"""Files into the mirror without the mirror reading them: uploads through the authenticated
API (resumable, sha256-checked), and file:// only inside the import dirs."""

from __future__ import annotations

import hashlib
import http.client
import os
import signal
from pathlib import Path

import httpx
import pytest

from llmgw.mirror import DOWNLOADING, FAILED, PRESENT, MirrorClient, MirrorError
from tests.mirror.conftest import MirrorProcess

SIZE = 3 * 1024 * 1024 + 77


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


@pytest.fixture
def model_file(tmp_path: Path) -> tuple[Path, bytes]:
    data = os.urandom(SIZE)
    path = tmp_path / "src" / "model.gguf"
    path.parent.mkdir()
    path.write_bytes(data)
    return path, data


class Offsets(httpx.HTTPTransport):
    """A transport that notes the offset of every upload it sends."""

    def __init__(self) -> None:
        super().__init__()
        self.offsets: list[int] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "PUT":
            self.offsets.append(int(request.url.params["offset"]))
        return super().handle_request(request)


def _send_part(mirror: MirrorProcess, path: Path, data: bytes, upto: int) -> None:
    """Start an upload of the whole file, send upto bytes of it, and drop the connection."""
    conn = http.client.HTTPConnection("127.0.0.1", mirror.api_port, timeout=10)
    conn.putrequest("PUT", f"/api/v1/import/m/v1/{path.name}?size={len(data)}"
                           f"&sha256={sha(data)}&offset=0")
    conn.putheader("Authorization", f"Bearer {mirror.token}")
    conn.putheader("Content-Length", str(len(data)))
    conn.endheaders()
    conn.send(data[:upto])
    conn.sock.close()


def _wait_bytes(mirror: MirrorProcess, n: int) -> None:
    from llmgw.host.waiting import Probe, wait_until

    def look() -> Probe:
        with mirror.client() as api:
            st = api.status("m", "v1")["status"]
        return Probe(st["bytes"] >= n, repr(st))

    wait_until(f"{n} bytes imported", look, timeout_s=30, interval_s=0.05)


def test_an_upload_is_present_checked_and_served(start_mirror, model_file) -> None:
    path, data = model_file
    mirror = start_mirror()
    with mirror.client() as api:
        done = api.upload(path, model="m", version="v1")
        assert done["status"]["state"] == PRESENT and done["status"]["sha256"] == sha(data)
        again = api.upload(path, model="m", version="v1")
        assert again == done, "uploading the same file again is a no-op"
    assert sha(httpx.get(done["url"]).content) == sha(data)
    assert not list((mirror.dir / "m" / "v1").glob(".*.partial"))


def test_a_dropped_upload_goes_on_from_the_bytes_the_mirror_kept(start_mirror, model_file):
    """The connection drops after a third of the file; the next upload sends the rest only."""
    path, data = model_file
    mirror = start_mirror()
    _send_part(mirror, path, data, SIZE // 3)
    _wait_bytes(mirror, SIZE // 3)
    with mirror.client() as api:
        assert api.status("m", "v1")["status"]["state"] == DOWNLOADING
    seen = Offsets()
    with MirrorClient(mirror.api_url, token=mirror.token, transport=seen) as api:
        done = api.upload(path, model="m", version="v1")
    assert seen.offsets == [SIZE // 3], seen.offsets
    assert done["status"]["state"] == PRESENT and done["status"]["sha256"] == sha(data)
    assert sha(httpx.get(done["url"]).content) == sha(data)


def test_an_upload_survives_a_mirror_restart(start_mirror, model_file) -> None:
    """A killed mirror keeps the partial and waits for the client (it has no source to
    download from); the upload then goes on where it stopped."""
    path, data = model_file
    first = start_mirror()
    _send_part(first, path, data, SIZE // 2)
    _wait_bytes(first, SIZE // 2)
    first.stop(signal.SIGKILL)
    second = start_mirror(first.dir, ports=(first.bytes_port, first.api_port))
    with second.client() as api:
        st = api.status("m", "v1")["status"]
        assert (st["state"], st["bytes"], st["err"]) == (DOWNLOADING, SIZE // 2, ""), st
        done = api.upload(path, model="m", version="v1")
    assert done["status"]["sha256"] == sha(data)


def test_a_wrong_digest_fails_naming_both_and_nothing_is_served(start_mirror, model_file):
    path, data = model_file
    mirror = start_mirror()
    wrong = sha(b"another file")
    with mirror.client() as api, pytest.raises(MirrorError, match="422") as err:
        api.upload(path, model="m", version="v1", sha256=wrong)
    assert wrong in str(err.value) and sha(data) in str(err.value)
    failed = mirror.wait_for("m", "v1", FAILED)
    assert httpx.get(failed["url"]).status_code == 404
    assert not (mirror.dir / "m" / "v1" / path.name).exists()
    with mirror.client() as api:  # the negative control: the right digest goes in
        assert api.upload(path, model="m", version="v1")["status"]["state"] == PRESENT


def test_another_file_under_a_present_name_is_refused(start_mirror, model_file, tmp_path):
    path, _ = model_file
    other = tmp_path / "model.gguf"
    other.write_bytes(b"something else")
    mirror = start_mirror()
    with mirror.client() as api:
        api.upload(path, model="m", version="v1")
        with pytest.raises(MirrorError, match="another version"):
            api.upload(other, model="m", version="v1")


def test_file_sources_outside_the_import_dirs_are_403_naming_them(start_mirror, model_file):
    path, data = model_file
    none = start_mirror()
    with none.client() as api, pytest.raises(MirrorError, match="403") as err:
        api.fetch(source=path.as_uri(), model="m", version="v1")
    assert "import dirs (none)" in str(err.value) and "llmgw mirror import" in str(err.value)
    assert not (none.dir / "m").exists(), "nothing written"


def test_file_sources_inside_an_import_dir_are_read(start_mirror, model_file, tmp_path):
    """Inside the dir: fetched. Outside, or a link inside that leads outside: 403."""
    path, data = model_file
    outside = tmp_path / "secret.txt"
    outside.write_text("secret")
    link = path.parent / "link.gguf"
    link.symlink_to(outside)
    mirror = start_mirror(tmp_path / "models2", import_dirs=(path.parent,))
    with mirror.client() as api:
        api.fetch(source=path.as_uri(), model="m", version="v1")
        assert mirror.wait_for("m", "v1", PRESENT)["status"]["sha256"] == sha(data)
        for source in (outside.as_uri(), link.as_uri(), f"file://{path.parent}/../secret.txt"):
            with pytest.raises(MirrorError, match="403") as err:
                api.fetch(source=source, model="m", version="v2")
            assert str(path.parent) in str(err.value)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}])
def test_without_the_admin_token_the_management_api_is_401(start_mirror, model_file,
                                                            headers) -> None:
    path, data = model_file
    mirror = start_mirror(import_dirs=(path.parent,))
    api = mirror.api_url
    calls = [
        httpx.post(f"{api}/api/v1/fetch", headers=headers,
                   json={"source": path.as_uri(), "model": "m", "version": "v1"}),
        httpx.put(f"{api}/api/v1/import/m/v1/x.gguf", headers=headers, content=b"x",
                  params={"size": 1, "sha256": sha(b"x")}),
        httpx.get(f"{api}/api/v1/models", headers=headers),
        httpx.get(f"{api}/api/v1/models/m/v1", headers=headers),
        httpx.get(f"{api}/metrics", headers=headers),
    ]
    for r in calls:
        assert r.status_code == 401, (r.request.url, r.text)
        assert str(mirror.token_path) in r.json()["detail"]
    assert httpx.get(f"{api}/health").status_code == 200
    assert not (mirror.dir / "m").exists(), "nothing written"
