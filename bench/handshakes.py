"""What one mutual-TLS handshake costs the agent API's server, with and without TLS 1.3
session tickets, side by side in one run.

Run on demand, not in the suite:
    python bench/handshakes.py [--handshakes 600] [--rounds 3]

Each side is a server process on the agent API's own context (`mtls_context`, a cluster CA
and certificates made at run time), answering one line per connection; one client makes
--handshakes connections one after another (a client certificate each time, as an agent
reconnecting) and reads the server's CPU time from /proc. The sides alternate for --rounds
rounds; it prints each round and ends with the median ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import ssl
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llmgw.control._tlsserver import new_event_loop  # noqa: E402
from llmgw.control.agent_api import mtls_context  # noqa: E402
from llmgw.host import pki  # noqa: E402
from llmgw.host.netaddr import free_port  # noqa: E402
from tests.procs import cpu_s  # noqa: E402

SIDES = {"no tickets (the agent API's)": 0, "two tickets (OpenSSL's default)": 2}


def serve(folder: str, port: int, tickets: int, ready: Any) -> None:
    ctx = mtls_context(f"{folder}/ca.pem", f"{folder}/server.pem", f"{folder}/server-key.pem")
    ctx.num_tickets = tickets

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\n")
            writer.write(b"ok\n")
            await writer.drain()
        except (OSError, asyncio.IncompleteReadError, ssl.SSLError):
            pass
        writer.close()

    async def main() -> None:
        await asyncio.start_server(answer, "127.0.0.1", port, ssl=ctx)
        ready.put(True)
        await asyncio.Event().wait()

    new_event_loop().run_until_complete(main())


async def handshakes(port: int, ctx: ssl.SSLContext, count: int) -> None:
    for _ in range(count):
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx,
                                                       server_hostname="127.0.0.1")
        writer.write(b"hi\n")
        await reader.readuntil(b"\n")
        writer.transport.abort()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--handshakes", type=int, default=600, help="per side per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="llmgw-handshakes-") as folder:
        ca = pki.create_ca()
        ca.write(folder, "ca")
        pki.issue_server(ca, ["127.0.0.1"]).write(folder, "server")
        cert, key = pki.issue_client(ca, "node-bench").write(folder, "client")
        client = ssl.create_default_context(cafile=f"{folder}/ca.pem")
        client.load_cert_chain(cert, key)
        servers: dict[str, tuple[multiprocessing.Process, int]] = {}
        for side, tickets in SIDES.items():
            port, ready = free_port(), multiprocessing.Queue()
            proc = multiprocessing.Process(target=serve, args=(folder, port, tickets, ready),
                                           daemon=True)
            proc.start()
            ready.get(timeout=30)
            servers[side] = proc, port
        loop = new_event_loop()
        ms: dict[str, list[float]] = {side: [] for side in SIDES}
        try:
            for _, port in servers.values():  # warm both, unmeasured
                loop.run_until_complete(handshakes(port, client, 50))
            for n in range(1, args.rounds + 1):
                for side, (proc, port) in servers.items():
                    before = cpu_s(proc.pid)
                    loop.run_until_complete(handshakes(port, client, args.handshakes))
                    ms[side].append((cpu_s(proc.pid) - before) / args.handshakes * 1e3)
                print(f"round {n}: " + "; ".join(
                    f"{side} {ms[side][-1]:.2f} ms of server CPU per handshake"
                    for side in SIDES), flush=True)
        finally:
            loop.close()
            for proc, _ in servers.values():
                proc.kill()
    without, with_ = (statistics.median(v) for v in ms.values())
    print(f"handshakes: server CPU without tickets / with: {without / with_:.2f}x "
          f"({without:.2f} ms vs {with_:.2f} ms, median of {args.rounds} rounds)")


if __name__ == "__main__":
    main()
