"""The `mirror` step's promises, under pytest provision/."""

from fixtures.promises.mirror import *  # noqa: F403
