#
# This file is part of gunicorn released under the MIT license.
# See the NOTICE for more information.

request = {
    "method": "GET",
    "uri": uri("/\xc3\xa0%20k"),
    "version": (1, 0),
    "headers": [
    ],
    "body": ''
}
