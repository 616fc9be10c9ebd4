"""Closing a connection of the HTTP core: on TLS, without waiting on the peer's close_notify."""

from __future__ import annotations

import asyncio

# How long a closed TLS connection may wait for the peer's close_notify.
TLS_CLOSE_GRACE_S = 1.0


def close_transport(transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
    """Close transport; on TLS, cut the socket once everything written has left, a
    TLS_CLOSE_GRACE_S after.

    A closed TLS connection waits for the peer's close_notify (30 s in uvloop), which an
    idle keep-alive client sends only when it next uses the connection: a draining server
    waited its whole bound for one (measured: an idle HTTPS client held the gateway's stop
    30 s)."""
    transport.close()
    if transport.get_extra_info("sslcontext") is not None:
        loop.call_later(TLS_CLOSE_GRACE_S, _abort_once_sent, transport, loop)


def _abort_once_sent(transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
    if transport.get_write_buffer_size():
        loop.call_later(TLS_CLOSE_GRACE_S, _abort_once_sent, transport, loop)
    else:
        transport.abort()
