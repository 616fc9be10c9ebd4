"""The HTTP/1.1 server core every listener's bytes pass through, and the ASGI shape."""
