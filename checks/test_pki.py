"""The `pki` step's promises, under pytest checks/."""

from fixtures.promises.pki import *  # noqa: F403
