"""Finding the llama.cpp tree inside a source archive's unpacked folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.agent.engines._build import BuildError, find_tree


def make(root: Path, *files: str) -> None:
    for f in files:
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        (root / f).write_text("")


def test_the_vendored_tree_wins_over_the_python_package_root(tmp_path) -> None:
    """llama-cpp-python's root has CMakeLists.txt and a Python examples/server: not it."""
    make(tmp_path, "llama_cpp_python-0.3.36/CMakeLists.txt",
         "llama_cpp_python-0.3.36/examples/server/app.py",
         "llama_cpp_python-0.3.36/vendor/llama.cpp/CMakeLists.txt",
         "llama_cpp_python-0.3.36/vendor/llama.cpp/tools/server/main.cpp")
    assert find_tree(tmp_path) == tmp_path / "llama_cpp_python-0.3.36/vendor/llama.cpp"


def test_a_plain_llama_cpp_archive(tmp_path) -> None:
    make(tmp_path, "llama.cpp-b1/CMakeLists.txt", "llama.cpp-b1/tools/server/server.cpp")
    assert find_tree(tmp_path) == tmp_path / "llama.cpp-b1"


def test_no_server_sources_is_an_error_naming_the_folder(tmp_path) -> None:
    make(tmp_path, "pkg/CMakeLists.txt", "pkg/examples/server/app.py")
    with pytest.raises(BuildError, match=str(tmp_path)):
        find_tree(tmp_path)
