#
# This file is part of gunicorn released under the MIT license.
# See the NOTICE for more information.

request = {
    "method": "GET",
    "uri": uri("/forums/1/topics/2375?page=1#posts-17408"),
    "version": (1, 1),
    "headers": [],
    "body": b""
}
