"""Sources and ranges: pure logic, no servers."""

from __future__ import annotations

import pytest

from llmgw.mirror._bytes import _Refused, byte_range, resolve
from llmgw.mirror._errors import SourceError
from llmgw.mirror._sources import parse, stated_digest

STARTER = "hf:Qwen/Qwen2.5-0.5B-Instruct-GGUF/qwen2.5-0.5b-instruct-q4_k_m.gguf"


def test_hf_sources_become_the_hub_resolve_url():
    source = parse(STARTER)
    assert source.url == (
        "https://huggingface.co/Qwen/Qwen2.5-0.5B-Instruct-GGUF/resolve/main/"
        "qwen2.5-0.5b-instruct-q4_k_m.gguf"
    )
    assert source.file_name == "qwen2.5-0.5b-instruct-q4_k_m.gguf"


def test_https_http_and_file_sources_keep_their_url_and_name_the_last_segment():
    for spec in ("https://x.example/a/b.gguf", "http://x/b.gguf?download=1", "file:///m/b.gguf"):
        assert parse(spec).file_name == "b.gguf"


@pytest.mark.parametrize("spec,why", [
    ("ftp://x/y.gguf", "scheme the mirror does not know"),
    ("hf:Qwen/only-repo", "hf:ORG/REPO/FILE"),
    ("https://x.example/", "cannot be a file name"),
    ("https://x.example/a/%2e%2e", "cannot be a file name"),
    ("file:///m/.hidden", "cannot be a file name"),
])
def test_sources_the_mirror_cannot_use_say_why(spec, why):
    with pytest.raises(SourceError, match=why):
        parse(spec)


def test_a_stated_digest_is_a_sha256_in_an_etag_or_nothing():
    digest = "a" * 64
    assert stated_digest(f'"{digest}"') == digest
    assert stated_digest(f'W/"{digest.upper()}"') == digest
    assert stated_digest('"5f2b-1a"') is None and stated_digest(None) is None


@pytest.mark.parametrize("header,expected", [
    ("bytes=100-199", (100, 199)),
    ("bytes=100-", (100, 999)),
    ("bytes=-10", (990, 999)),
    ("bytes=900-5000", (900, 999)),
    (None, None),
    ("bytes=0-1,5-6", None),  # several ranges: the whole file is a valid answer
    ("items=1-2", None),
    ("bytes=20-10", None),
])
def test_single_ranges(header, expected):
    assert byte_range(header, 1000) == expected


@pytest.mark.parametrize("header", ["bytes=1000-", "bytes=5000-6000", "bytes=-0"])
def test_ranges_past_the_end_are_416(header):
    with pytest.raises(_Refused) as found:
        byte_range(header, 1000)
    assert found.value.status == 416 and found.value.headers == {"Content-Range": "bytes */1000"}


def test_targets_resolve_under_a_base_path_only():
    assert resolve("/models/m/v1/f.gguf", "/models") == ("m", "v1", "f.gguf")
    with pytest.raises(_Refused):
        resolve("/m/v1/f.gguf", "/models")
