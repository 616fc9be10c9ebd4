"""A GGUF's general.name read from its header, checked against the gguf package's reader."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.model.ggufmeta import GGUFError, catalog_name, general_name
from tests.tiny_gguf import write_tiny_gguf


def test_general_name_is_what_the_gguf_package_reads(tmp_path: Path) -> None:
    """The header reader and gguf's GGUFReader agree on the tests' tiny model."""
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    field = gguf.GGUFReader(path).fields["general.name"]
    assert general_name(path) == bytes(field.parts[field.data[0]]).decode() == "llmgw-tiny-test"


def test_a_file_without_a_name_gives_empty(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "nameless.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("x.count", 3)
    w.add_array("x.list", ["a", "bb"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    assert general_name(path) == ""


def test_not_a_gguf_and_a_cut_header_are_refused_saying_so(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(b"PK\x03\x04 not a model")
    with pytest.raises(GGUFError, match="not b'GGUF', so it is not a GGUF model file"):
        general_name(path)
    whole = tmp_path / "tiny.gguf"
    write_tiny_gguf(whole)
    path.write_bytes(whole.read_bytes()[:40])
    with pytest.raises(GGUFError, match="cut short"):
        general_name(path)


@pytest.mark.parametrize(("given", "name"), [
    ("Gemma 3 1B IT", "gemma-3-1b-it"), ("Qwen2.5-0.5B-Instruct", "qwen2.5-0.5b-instruct"),
    ("  ", ""), ("Llama_3/8B", "llama_3-8b"),
])
def test_catalog_name_is_lower_case_with_dashes(given: str, name: str) -> None:
    assert catalog_name(given) == name
