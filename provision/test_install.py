"""The `install` step's promises, under pytest provision/."""

from fixtures.promises.install import *  # noqa: F403
