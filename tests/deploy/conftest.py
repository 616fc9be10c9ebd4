"""Fixtures for the shipped Prometheus rules and Grafana dashboard: Debian's promtool and
prometheus binaries."""

from __future__ import annotations

import os
import shutil

import pytest


def _binary(name: str) -> str:
    """The binary's path; skipped (failed as root, where scripts/bootstrap installs it)
    with what to install when it is missing."""
    found = shutil.which(name)
    if found:
        return found
    why = (f"{name} is not installed: `apt-get install --no-install-recommends prometheus` "
           "(Debian's package gives prometheus and promtool), or run scripts/bootstrap as root")
    if os.geteuid() == 0:
        pytest.fail(why)
    pytest.skip(why)


@pytest.fixture(scope="session")
def promtool() -> str:
    """Session: the path of promtool (Debian's `prometheus` package); skipped with what to
    install where it is missing and this is not root. Changes nothing."""
    return _binary("promtool")


@pytest.fixture(scope="session")
def prometheus_binary() -> str:
    """Session: the path of the prometheus server binary, found as `promtool` is."""
    return _binary("prometheus")
