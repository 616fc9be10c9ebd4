"""cli.model_source: which sources are model files, a download that breaks or is not GGUF
leaving no file behind (a real loopback server), and progress said at tenths."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from llmgw.cli.model_source import download, is_model_source, progress_lines, resolve
from llmgw.errors import Error
from llmgw.mirror._errors import SourceError
from llmgw.model.ggufmeta import GGUFError
from tests.servers import raw_server


def test_a_model_file_is_told_from_a_yaml_spec(tmp_path: Path, tiny_gguf) -> None:
    """GGUF magic or a .gguf name make a model file; anything else stays a YAML spec (as
    before), whatever its name."""
    spec = tmp_path / "model"
    spec.write_text("name: m\n")
    renamed = tmp_path / "weights.bin"
    renamed.write_bytes(tiny_gguf[0].read_bytes())
    assert not is_model_source(str(spec)) and not is_model_source(str(tmp_path / "m.yaml"))
    assert is_model_source(str(renamed)) and is_model_source(str(tmp_path / "absent.gguf"))
    for remote in ("hf:o/r/f.gguf", "https://h/f.gguf", "file:///x", "s3://b/f.gguf"):
        assert is_model_source(remote), remote


def test_hf_sources_resolve_against_hf_endpoint(monkeypatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.example/")
    found = resolve("hf:Org/Repo/sub/m.gguf@v2")
    assert not isinstance(found, Path)
    assert found.url == "https://hub.example/Org/Repo/resolve/v2/sub/m.gguf"
    assert resolve("file:///srv/m.gguf") == Path("/srv/m.gguf")
    with pytest.raises(SourceError, match="not a .gguf file"):
        resolve("hf:Org/Repo/config.json")


def _answer(head: bytes, body: bytes, length: int) -> object:
    def handle(conn: socket.socket) -> None:
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % length
                         + head + body)
    return handle


@pytest.mark.parametrize(("head", "length_extra", "raised", "says"), [
    (b"GGUF", 1000, Error, "broke at byte 5004"),  # the server closes early
    (b"<htm", 0, GGUFError, "is not a GGUF model file"),
])
def test_a_download_that_breaks_or_is_not_gguf_leaves_nothing(
        tmp_path, head, length_extra, raised, says) -> None:
    """Control: the same server sending the whole GGUF-headed body leaves the file."""
    body = b"\0" * 5000
    lines: list[str] = []
    with raw_server(_answer(head, body, len(head) + len(body) + length_extra)) as url:
        source = resolve(f"{url}/m.gguf")
        assert not isinstance(source, Path)
        with pytest.raises(raised, match=says):
            download(source, tmp_path, progress_lines("m", out=lines.append))
    assert list(tmp_path.iterdir()) == []
    with raw_server(_answer(b"GGUF", body, len(body) + 4)) as url:
        source = resolve(f"{url}/m.gguf")
        assert not isinstance(source, Path)
        got = download(source, tmp_path, progress_lines("m", out=lines.append))
    assert got.read_bytes() == b"GGUF" + body


def test_progress_is_said_at_tenths_at_most_once_a_second_and_at_the_end() -> None:
    now = [0.0]
    lines: list[str] = []
    say = progress_lines("f", out=lines.append, clock=lambda: now[0])(100 << 20)
    for done in range(0, 101, 5):
        say(done << 20)
        now[0] += 0.6
    assert lines[0].startswith("f: 0% (0.0 MiB of 100.0 MiB")
    assert lines[-1].startswith("f: 100% (100.0 MiB of 100.0 MiB")
    # A tenth passes every 1.2 s here: each is said, none twice.
    assert 5 <= len(lines) <= 11 and len(set(lines)) == len(lines)
