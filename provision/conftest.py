"""pytest provision/: fixes may run (with --plan: they are only said)."""

import pytest


@pytest.fixture(scope="session")
def llmgw_apply() -> bool:
    """Session: True, so each promise that does not hold is fixed, then probed again."""
    return True
