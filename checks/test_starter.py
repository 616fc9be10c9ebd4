"""The `starter` step's promises, under pytest checks/."""

from fixtures.promises.starter import *  # noqa: F403
