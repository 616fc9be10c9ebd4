"""What a header that never ends costs the gateway's server: its RSS growth under one
32 MiB unterminated header line (a value, then a name), no key needed. Run on demand:

    python bench/http1_header_rss.py [--mib 32] [--runs 1] [--max-head-bytes N]

The HTTP core (`llmgw.http1.server.Http1Server`, default Limits, an app that answers 200) runs in
a child process on loopback; the client sends a request line, then one header line of the
given size in 64 KiB writes without its end, and reads what comes back. The child's
VmRSS (/proc/PID/status) is read before and at the end. The last line:
`header RSS growth: value N.N MiB, name N.N MiB (goal < 16 MiB)`.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from llmgw.host.netaddr import free_port  # noqa: E402
from llmgw.http1.limits import Limits  # noqa: E402

CHILD = """
import sys
from llmgw.http1.server import Http1Server
from llmgw.http1.limits import Limits

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})

Http1Server(app, sys.argv[1], limits=Limits(max_head_bytes=int(sys.argv[2]))).run()
"""


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def wait_listening(port: int, within_s: float = 20.0) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"the server did not listen on 127.0.0.1:{port} within {within_s} s")


def one_case(kind: str, mib: int, max_head: int) -> tuple[float, str]:
    """RSS growth in MiB, and how the server answered."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    child = subprocess.Popen([sys.executable, "-c", CHILD, f"127.0.0.1:{port}", str(max_head)],
                             env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_listening(port)
        # A request first, so the child has served once (imports and buffers warmed).
        with socket.create_connection(("127.0.0.1", port), timeout=10) as warm:
            warm.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            while warm.recv(65536):
                pass
        before = rss_kib(child.pid)
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n" + (b"X-Big: " if kind == "value" else b""))
        block, sent, answer = b"v" * 65536, 0, b""
        try:
            while sent < mib << 20:
                sock.sendall(block)
                sent += len(block)
        except (BrokenPipeError, ConnectionResetError):
            pass
        sock.settimeout(2.0)
        try:
            answer = sock.recv(4096)
        except (TimeoutError, ConnectionResetError):
            pass
        time.sleep(0.5)
        after = rss_kib(child.pid)
        sock.close()
        said = answer.split(b"\r\n", 1)[0].decode("latin-1") or "no answer"
        return (after - before) / 1024, f"{said} after {sent >> 20} MiB sent"
    finally:
        child.terminate()
        child.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=32)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--max-head-bytes", type=int, default=Limits().max_head_bytes,
                        help="the core's head limit (raise it past --mib for the control: "
                             "the growth the limit prevents)")
    args = parser.parse_args()
    for run in range(1, args.runs + 1):
        grown = {}
        for kind in ("value", "name"):
            grown[kind], said = one_case(kind, args.mib, args.max_head_bytes)
            print(f"run {run}, a {args.mib} MiB header {kind}: RSS +{grown[kind]:.1f} MiB ({said})")
        print(f"header RSS growth: value {grown['value']:.1f} MiB, name {grown['name']:.1f} MiB "
              "(goal < 16 MiB)")


if __name__ == "__main__":
    main()
