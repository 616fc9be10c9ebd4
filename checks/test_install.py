"""The `install` step's promises, under pytest checks/."""

from fixtures.promises.install import *  # noqa: F403
