"""The `starter` step's promises, under pytest provision/."""

from fixtures.promises.starter import *  # noqa: F403
