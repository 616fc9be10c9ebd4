"""A raw loopback client that reads answers exactly as the server framed them, and the
small requests and ASGI answers the HTTP core's tests build from."""

from __future__ import annotations

import socket
import ssl
from dataclasses import dataclass
from typing import Any

# The bound on every read and wait: reached only when something is wrong.
WAIT_S = 5.0


@dataclass
class Answer:
    status: int
    headers: dict[str, str]  # names lowered
    body: bytes
    raw: bytes  # the bytes on the wire, head included


class Client:
    """One raw loopback connection that reads answers exactly as the server framed them."""

    def __init__(self, port: int, receive_buffer: int = 0,
                 context: ssl.SSLContext | None = None) -> None:
        sock = socket.socket()
        if receive_buffer:  # set before connecting: the window is agreed then
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        sock.settimeout(WAIT_S)
        sock.connect(("127.0.0.1", port))
        self.sock = context.wrap_socket(sock, server_hostname="127.0.0.1") if context else sock
        self.buffer = b""

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _more(self) -> None:
        part = self.sock.recv(1 << 16)
        if not part:
            raise ConnectionError(f"the server closed the connection; unread: {self.buffer!r}")
        self.buffer += part

    def until(self, marker: bytes) -> bytes:
        """Everything up to and with marker."""
        while marker not in self.buffer:
            self._more()
        got, self.buffer = self.buffer.split(marker, 1)
        return got + marker

    def exactly(self, n: int) -> bytes:
        while len(self.buffer) < n:
            self._more()
        got, self.buffer = self.buffer[:n], self.buffer[n:]
        return got

    def answer(self, head_only: bool = False) -> Answer:
        """The next answer: its head, and its body as framed (content-length or chunks)."""
        raw = self.until(b"\r\n\r\n")
        status_line, *lines = raw[:-4].decode("latin-1").split("\r\n")
        assert status_line.startswith("HTTP/1.1 "), f"not an HTTP/1.1 status line: {raw!r}"
        headers = {}
        for line in lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        status = int(status_line.split()[1])
        wire, body = [raw], b""
        if head_only or status < 200 or status in (204, 304):
            pass
        elif headers.get("transfer-encoding") == "chunked":
            while True:
                size_line = self.until(b"\r\n")
                size = int(size_line[:-2], 16)
                wire += [size_line, self.exactly(size + 2)]
                if size == 0:
                    break
            body = b"".join(chunk[:-2] for chunk in wire[2::2])
        else:
            body = self.exactly(int(headers["content-length"]))
            wire.append(body)
        return Answer(status, headers, body, b"".join(wire))

    def closed(self, within: float = WAIT_S) -> bool:
        """Whether the server closes the connection within that long, sending nothing more."""
        self.sock.settimeout(within)
        try:
            part = self.sock.recv(1 << 16)
        except TimeoutError:
            return False
        except (ConnectionResetError, ssl.SSLError):
            return True
        finally:
            self.sock.settimeout(WAIT_S)
        self.buffer += part
        return not part


def get(path: str = "/", *extra: str, method: str = "GET", version: str = "1.1") -> bytes:
    lines = [f"{method} {path} HTTP/{version}", "Host: 127.0.0.1", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def answer(send: Any, body: bytes, status: int = 200,
                 headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """An answer whose body comes in one message: the server sets its content-length."""
    await send({"type": "http.response.start", "status": status,
                "headers": headers or [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": body})


async def read_body(receive: Any) -> tuple[bytes, int]:
    """The whole request body and how many http.request messages it came in."""
    parts = []
    while True:
        message = await receive()
        assert message["type"] == "http.request", message
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(parts), len(parts)
