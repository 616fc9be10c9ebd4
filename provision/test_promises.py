"""pytest provision/: every promise of every step; what does not hold is fixed, then probed."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # the harness is `fixtures` in a checkout, `llmgw_harness` when installed
    from fixtures._promise import Promise
    from fixtures._run import Run


def test_promise(llmgw_promise: Promise, llmgw_run: Run, request: pytest.FixtureRequest) -> None:
    llmgw_run.judge(llmgw_promise, request.node)
