"""The one test of the harness: each promise, judged. `pytest provision/`, `pytest checks/`
and `llmgw check` collect this function (the first two import it into their own module)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from llmgw_harness._promise import Promise
    from llmgw_harness._run import Run


def test_promise(llmgw_promise: Promise, llmgw_run: Run, request: pytest.FixtureRequest) -> None:
    llmgw_run.judge(llmgw_promise, request.node)
