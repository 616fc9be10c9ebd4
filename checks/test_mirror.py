"""The `mirror` step's promises, under pytest checks/ (verify only)."""

from fixtures.promises.mirror import *  # noqa: F403
