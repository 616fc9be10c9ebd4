"""The `control_plane` step's promises, under pytest provision/."""

from fixtures.promises.control_plane import *  # noqa: F403
