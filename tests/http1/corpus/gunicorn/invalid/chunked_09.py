#
# This file is part of gunicorn released under the MIT license.
# See the NOTICE for more information.

from gunicorn.http.errors import InvalidChunkSize
request = InvalidChunkSize
