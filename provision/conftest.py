"""pytest provision/: every step may change the host (ensure, then verify)."""

import pytest


@pytest.fixture(scope="session")
def llmgw_apply() -> bool:
    """Session: True, so each step makes the host as it should be before verifying."""
    return True
