"""pytest checks/: every promise of every step, probed; nothing on the host changes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from fixtures import _fleet

if TYPE_CHECKING:  # the harness is `fixtures` in a checkout, `llmgw_harness` when installed
    from fixtures._promise import Promise
    from fixtures._run import Run
    from llmgw.remote import PromiseRecord


def test_promise(llmgw_promise: Promise, llmgw_run: Run, request: pytest.FixtureRequest) -> None:
    llmgw_run.judge(llmgw_promise, request.node)


@pytest.mark.filterwarnings("ignore::pytest.PytestExperimentalApiWarning")
def test_on_host(llmgw_remote: PromiseRecord, record_xml_attribute: Any) -> None:
    """--hosts: one promise as it ended on its host (checks/ only; `llmgw check` is one host)."""
    _fleet.judge(llmgw_remote, record_xml_attribute)
