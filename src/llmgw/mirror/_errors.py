"""The mirror's errors, shared by its server and its client."""

from __future__ import annotations

from llmgw.errors import APIError


class MirrorError(APIError):
    """The mirror could not be reached, refused a request, or could not get a model.

    MirrorError
     ├── MirrorNotFound   the management API answered 404: no such model/version
     ├── SourceError      a source that cannot be turned into a download
     └── Forbidden        a source the mirror may not read (file:// outside its import dirs)
    """


class MirrorNotFound(MirrorError):
    """The management API answered 404: the mirror holds no such model and version."""


class SourceError(MirrorError):
    """A source the mirror cannot download from (unknown scheme, no file name)."""


class Forbidden(MirrorError):
    """A source the mirror may not read: a file:// path outside its import dirs."""
