"""The `node` step's promises, under pytest provision/."""

from fixtures.promises.node import *  # noqa: F403
