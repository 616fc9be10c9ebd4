"""The `pki` step's promises, under pytest provision/."""

from fixtures.promises.pki import *  # noqa: F403
