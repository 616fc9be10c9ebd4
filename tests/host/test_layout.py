"""The layout's local-mode-only files: under the state dir in local mode, an error that says
so in system mode."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.errors import Error
from llmgw.host.layout import Layout

SUPERVISOR_FILES = {"supervisord_conf": "supervisord.conf", "supervisor_programs": "supervisor.d",
                    "supervisor_socket": "supervisor.sock", "supervisord_pid": "supervisord.pid"}


def test_supervisords_files_are_in_the_local_state_dir(tmp_path: Path) -> None:
    layout = Layout.for_mode("local", tmp_path)
    assert {a: getattr(layout, a) for a in SUPERVISOR_FILES} == {
        a: tmp_path / name for a, name in SUPERVISOR_FILES.items()}


@pytest.mark.parametrize("attribute", SUPERVISOR_FILES)
def test_a_system_host_has_no_supervisord_file_and_says_so(attribute: str) -> None:
    """(Control: the same read on a local layout, above, gives a path.)"""
    with pytest.raises(Error, match=f"^{SUPERVISOR_FILES[attribute]} exists only in local "
                                    "mode; this host is in system mode$"):
        getattr(Layout.for_mode("system"), attribute)
