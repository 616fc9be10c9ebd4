"""The `control_plane` step's promises, under pytest checks/."""

from fixtures.promises.control_plane import *  # noqa: F403
