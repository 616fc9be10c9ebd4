"""What a service process imported and how its listener answers, for the tests that hold
every service to llmgw's own HTTP core (`llmgw.http1.server.Http1Server`)."""

from __future__ import annotations

import socket
from pathlib import Path

# A request the core refuses itself, in words of its own; an app behind another server
# would be handed it (FastAPI answers 404 or 405).
CONNECT = b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n"
CORE_REFUSAL = b"CONNECT is not served: this server is no proxy"


def imported(log: Path) -> set[str]:
    """The modules a process run with `python -X importtime` imported, from its stderr."""
    names = set()
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            names.add(line.rsplit("|", 1)[1].strip())
    return names


def connect_answer(port: int) -> bytes:
    """What the listener on loopback port says to a CONNECT, until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(CONNECT)
        answer = b""
        while chunk := s.recv(4096):
            answer += chunk
    return answer
