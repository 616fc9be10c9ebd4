"""The `node` step's promises, under pytest checks/."""

from fixtures.promises.node import *  # noqa: F403
