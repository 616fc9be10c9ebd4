"""pytest provision/: every promise of every step; what does not hold is fixed, then probed."""

from llmgw_harness.suite.test_promises import test_promise

__all__ = ["test_promise"]
