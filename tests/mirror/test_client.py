"""The mirror client's own logic: errors when nothing answers."""

from __future__ import annotations

import pytest

from llmgw.errors import Error
from llmgw.mirror import MirrorClient, MirrorError, MirrorNotFound
from tests.hosts import free_port


def test_errors_are_llmgw_errors_and_404_is_its_own():
    assert issubclass(MirrorNotFound, MirrorError) and issubclass(MirrorError, Error)


def test_an_unreachable_mirror_is_a_mirror_error_naming_it():
    url = f"http://127.0.0.1:{free_port()}"
    with MirrorClient(url, timeout=2.0) as client, pytest.raises(MirrorError, match=url):
        client.health()
