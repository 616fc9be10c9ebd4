"""Fake llama-server binaries (real executables that answer --version and --list-devices),
and a test cluster's certificates."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.agent.cluster_pki import Cluster, make_cluster

FakeBinary = Callable[..., Path]


@pytest.fixture
def fake_llama_server(tmp_path: Path) -> FakeBinary:
    """Function: makes DIR/llama-server answering `version: BUILD (commit)` on stderr."""

    def make(directory: Path, build: str = "4242", devices: str = "", rc: int = 0) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / "llama-server"
        path.write_text(
            "#!/bin/sh\n"
            'case "$1" in\n'
            f'  --version) echo "version: {build} (0c1e570)" >&2; echo "built with cc" >&2;'
            f" exit {rc} ;;\n"
            f'  --list-devices) echo "Available devices:"; printf "{devices}"; exit {rc} ;;\n'
            "esac\nexit 2\n"
        )
        path.chmod(0o755)
        return path

    return make


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Cluster:
    """Module: certificates for the split replicas' relays (tests/agent/cluster_pki.py),
    made now."""
    return make_cluster(tmp_path_factory.mktemp("pki"))
