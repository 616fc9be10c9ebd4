"""hf: sources: a revision, a hub named by HF_ENDPOINT, and HF_TOKEN sent to the hub only."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from llmgw.mirror._errors import SourceError
from llmgw.mirror._sources import hub_environment, open_at, parse

DATA = b"weights" * 1000


class Recording(ThreadingHTTPServer):
    """A loopback server that records (path, Authorization) of every request."""

    def __init__(self, redirect_to: str = "") -> None:
        self.seen: list[tuple[str, str | None]] = []
        self.redirect_to = redirect_to
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                server.seen.append((self.path, self.headers.get("Authorization")))
                if server.redirect_to:
                    self.send_response(302)
                    self.send_header("Location", server.redirect_to)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(DATA)))
                self.end_headers()
                self.wfile.write(DATA)

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_port}"


@pytest.fixture
def hub_and_cdn(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Recording, Recording]]:
    """Function: a hub that redirects every file to a CDN (another origin), named by
    HF_ENDPOINT, with HF_TOKEN set."""
    cdn = Recording()
    hub = Recording(redirect_to=f"{cdn.url}/blob/xyz")
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    yield hub, cdn
    for server in (hub, cdn):
        server.shutdown()
        server.server_close()


def test_a_revision_picks_what_the_hub_resolves() -> None:
    assert "/resolve/main/" in parse("hf:Org/Repo/model.gguf").url
    assert parse("hf:Org/Repo/dir/model.gguf@v1.0").url.endswith("/resolve/v1.0/dir/model.gguf")
    assert "/resolve/refs%2Fpr%2F1/" in parse("hf:Org/Repo/m.gguf@refs/pr/1").url
    assert parse("hf:Org/Repo/m.gguf@abc123").file_name == "m.gguf"
    with pytest.raises(SourceError, match=r"\[@REVISION\]"):
        parse("hf:Org/Repo/m.gguf@")


def test_the_token_goes_to_the_hub_and_not_to_its_cdn(hub_and_cdn) -> None:
    hub, cdn = hub_and_cdn
    source = parse("hf:Org/Repo/model.gguf@main")
    with httpx.Client(follow_redirects=True) as client, \
            open_at(source, 0, None, client) as opened:
        assert b"".join(opened.chunks) == DATA
    assert hub.seen == [("/Org/Repo/resolve/main/model.gguf", "Bearer hf_secret")]
    assert cdn.seen == [("/blob/xyz", None)]


def test_the_token_never_goes_to_other_sources(hub_and_cdn) -> None:
    _, cdn = hub_and_cdn
    source = parse(f"{cdn.url}/files/model.gguf")
    assert source.token == ""
    with httpx.Client() as client, open_at(source, 0, None, client) as opened:
        b"".join(opened.chunks)
    assert cdn.seen == [("/files/model.gguf", None)]
    assert "hf_secret" not in repr(source)


def test_the_mirror_service_gets_only_the_hub_variables() -> None:
    env = {"HF_TOKEN": "t", "HF_ENDPOINT": "https://hub.example", "HOME": "/root", "HF_X": "1"}
    assert hub_environment(env) == {"HF_TOKEN": "t", "HF_ENDPOINT": "https://hub.example"}
    assert hub_environment({"HF_TOKEN": ""}) == {}


@pytest.mark.parametrize("url, no_proxy, proxied", [
    ("https://huggingface.co", "", True),
    ("https://huggingface.co", "huggingface.co", False),
    ("https://cdn.huggingface.co", ".huggingface.co", False),
    ("https://xhuggingface.co", "huggingface.co", True),
    ("https://127.0.0.1:9", "localhost, 127.0.0.1:9", False),
    ("https://[::1]:9", "::1", False),
    ("https://hub.example", "*", False),
    ("http://hub.example", "", False),  # HTTP_PROXY is not set: only HTTPS_PROXY is
])
def test_the_mirrors_proxy_is_the_one_httpx_would_take(url: str, no_proxy: str,
                                                       proxied: bool) -> None:
    from llmgw.mirror._sources import proxy_for

    env = {"HTTPS_PROXY": "http://proxy.example:3128", "NO_PROXY": no_proxy}
    assert proxy_for(url, env) == ("http://proxy.example:3128" if proxied else "")
