"""The mirror client's own logic: percent, and errors when nothing answers."""

from __future__ import annotations

import pytest

from llmgw.errors import Error
from llmgw.mirror import FetchStatus, MirrorClient, MirrorError, MirrorNotFound
from tests.hosts import free_port


def test_percent_is_whole_and_unknown_without_a_total():
    assert FetchStatus("downloading", bytes=999, total=1000).percent == 99
    assert FetchStatus("downloading", bytes=5).percent is None
    assert FetchStatus("present", bytes=1000, total=1000).percent == 100


def test_errors_are_llmgw_errors_and_404_is_its_own():
    assert issubclass(MirrorNotFound, MirrorError) and issubclass(MirrorError, Error)


def test_an_unreachable_mirror_is_a_mirror_error_naming_it():
    url = f"http://127.0.0.1:{free_port()}"
    with MirrorClient(url, timeout=2.0) as client, pytest.raises(MirrorError, match=url):
        client.health()
