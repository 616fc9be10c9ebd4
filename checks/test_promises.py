"""pytest checks/: every promise of every step, probed; nothing on the host changes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from llmgw_harness import _fleet
from llmgw_harness.suite.test_promises import test_promise

if TYPE_CHECKING:
    from llmgw.cli.remote import PromiseRecord

__all__ = ["test_on_host", "test_promise"]


@pytest.mark.filterwarnings("ignore::pytest.PytestExperimentalApiWarning")
def test_on_host(llmgw_remote: PromiseRecord, record_xml_attribute: Any) -> None:
    """--hosts: one promise as it ended on its host (checks/ only; `llmgw check` is one host)."""
    _fleet.judge(llmgw_remote, record_xml_attribute)
