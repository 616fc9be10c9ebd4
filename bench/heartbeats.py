"""How many nodes the agent API holds: simulated nodes heartbeating over real mutual TLS.

Run on demand, not in the suite, and on any change to the heartbeat path:
    python bench/heartbeats.py --nodes 1000,2000,5000 --duration 30 [--modes keepalive,new]
    python bench/heartbeats.py --nodes 5000 --modes restart --duration 60
    python bench/heartbeats.py --nodes 2000,5000 --modes keepalive --old-src ../old/src
    python bench/heartbeats.py --nodes 2000 --modes spread
    python bench/heartbeats.py --nodes 2000,5000 --modes keepalive,watch

Starts the real control plane (`llmgw server`, its own CA) and, in separate processes, N
simulated nodes, each with its own client certificate made at run time with llmgw.host.pki.
Every node sends the agent's heartbeat body every --interval seconds, spread evenly over
the interval; `keepalive` holds one connection per node (as the agent does), `new` opens
a TCP and TLS connection per beat (as the agent did when httpx's 5 s keep-alive expiry
equalled the 5 s interval); `watch` beats as `keepalive` does and each node also holds a
watch (AgentPaths.WATCH) on a second connection, as the agent does, held again whenever
answered: its rows beside keepalive's are what held watches cost (the control plane's
resident memory, RSS, is printed with each row). Connections are made during a first
interval that is not measured; then for --duration seconds it counts answered beats
(200), failures by kind, latency (request sent to answer read; including connect in
`new` mode) and the control plane's thread count.

Each row is compared with the figures recorded in heartbeats_recorded.json beside this
file (bench/README.md's): a control-plane CPU a beat more than GROWN_AT above the record
is said plainly. With --old-src, another checkout's control plane (its src folder) runs
the same rows just before this checkout's, on a control plane of its own, so the two are
measured back to back under the same load.

`spread` starts a PostgreSQL server and two control planes on it, one fleet, and nodes that
beat as agents do: agent.yaml names the first, each learns both from the answers, moves to
its home (llmgw.agent.control_planes, the agent's own code) and fails over within the
agent's failover_timeout_s. It prints each control plane's share of the beats, how long
the second one's nodes went unheard when it stopped, whether any was shown not_ready, and
how its nodes came back when it started again.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import os
import shutil
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llmgw.agent.agent import backoff_s  # noqa: E402
from llmgw.agent.control_planes import ControlPlanes  # noqa: E402
from llmgw.config import AgentConfig  # noqa: E402
from llmgw.contract import AgentPaths  # noqa: E402
from llmgw.control._tlsserver import new_event_loop  # noqa: E402
from llmgw.host import pki  # noqa: E402
from tests.fleet.cluster import ControlPlane  # noqa: E402
from tests.postgres import PostgresServer, bindir  # noqa: E402

TIMEOUT_S = 10.0
RECORDED = Path(__file__).with_name("heartbeats_recorded.json")
# CPU a beat this much above the record is a regression to find before merging.
GROWN_AT = 0.25
# restart mode: when the restart comes, and how long the nodes may take to come back.
RESTART_AFTER_S = 5.0
BACK_WITHIN_S = 60.0


def inventory(node: str) -> bytes:
    """What a CPU node's agent sends: the same fields and about the same size."""
    return json.dumps({
        "node_id": node, "gpus": [], "cpus": 2, "memory_mb": 24000,
        "labels": {"zone": "bench"}, "engines": ["llamacpp"],
        "provision": [{"engine": "llamacpp", "version": "0.3.36", "state": "ready",
                       "detail": "/root/.cache/llmgw/engines/llamacpp/0.3.36/llama-server"}],
        "interface": "eth0", "addr": "10.0.0.1", "warnings": [], "replicas": [],
    }).encode()


def request(node: str, port: int, keep: bool) -> bytes:
    body = inventory(node)
    head = (f"POST {AgentPaths.HEARTBEAT} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            "Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: {'keep-alive' if keep else 'close'}"
            "\r\n\r\n")
    return head.encode() + body


async def read_reply(reader: asyncio.StreamReader) -> int:
    return (await read_reply_body(reader))[0]


async def read_reply_body(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return status, await reader.readexactly(length)


class Node:
    """One simulated node: its TLS identity and its beats."""

    def __init__(self, name: str, ctx: ssl.SSLContext, port: int, keep: bool,
                 watch: bool = False) -> None:
        self.name, self.ctx, self.port, self.keep = name, ctx, port, keep
        self.conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self.payload = request(name, port, keep)
        self.failures = 0  # in a row, as the agent counts them for its backoff
        # watch mode: the revision of the last answer, and the task holding the watch
        self.watch, self.revision = watch, ""
        self.watcher: asyncio.Task[None] | None = None
        self.watched = {"answered": 0, "failed": 0}

    async def hold_watches(self) -> None:
        """Hold a watch on a connection of its own, again whenever it is answered."""
        conn = None
        try:
            while True:
                if conn is None:
                    conn = await asyncio.open_connection(
                        "127.0.0.1", self.port, ssl=self.ctx, server_hostname="127.0.0.1")
                conn[1].write(f"GET {AgentPaths.WATCH}?since={self.revision} HTTP/1.1\r\n"
                              f"Host: 127.0.0.1:{self.port}\r\n\r\n".encode())
                try:
                    status, _ = await asyncio.wait_for(read_reply_body(conn[0]), 75.0)
                    self.watched["answered" if status == 200 else "failed"] += 1
                    if status != 200:  # an older control plane: the agent stops watching
                        return
                except (OSError, asyncio.IncompleteReadError, ssl.SSLError, TimeoutError):
                    self.watched["failed"] += 1
                    conn[1].transport.abort()
                    conn = None
                    await asyncio.sleep(1.0)
        finally:
            if conn is not None:
                conn[1].transport.abort()

    async def beat_as_agent(self) -> int:
        """A beat the way the agent's client sends it: a kept-alive connection the server
        dropped is made again at once, once."""
        if self.conn is None:
            return await self.beat()
        try:
            return await self.beat()
        except (OSError, asyncio.IncompleteReadError, ssl.SSLError):
            self.close()
            return await self.beat()

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.conn is None:
            self.conn = await asyncio.open_connection("127.0.0.1", self.port, ssl=self.ctx,
                                                      server_hostname="127.0.0.1")
        return self.conn

    async def beat(self) -> int:
        reader, writer = await self.connect()
        writer.write(self.payload)
        status, body = await read_reply_body(reader)
        if not self.keep:
            self.close()
        if self.watch and status == 200 and self.watcher is None:
            self.revision = json.loads(body).get("revision", "")
            self.watcher = asyncio.ensure_future(self.hold_watches())
        return status

    def close(self) -> None:
        if self.conn is not None:
            self.conn[1].transport.abort()
            self.conn = None


async def run_nodes(nodes: list[Node], interval: float, start: float, measure_from: float,
                    end: float, as_agent: bool = False) -> dict[str, Any]:
    latencies: list[float] = []
    failures: dict[str, int] = {}
    beats = {"sent": 0}

    async def one(i: int, node: Node) -> None:
        at = start + interval * i / len(nodes)
        while at < end:
            await asyncio.sleep(max(0.0, at - time.time()))
            sent = time.time()
            try:
                status = await asyncio.wait_for(
                    node.beat_as_agent() if as_agent else node.beat(), TIMEOUT_S)
                kind = "" if status == 200 else f"HTTP {status}"
            except Exception as e:  # every failure is counted by its kind
                node.close()
                kind = type(e).__name__
            if sent >= measure_from:
                beats["sent"] += 1
                if kind:
                    failures[kind] = failures.get(kind, 0) + 1
                else:
                    latencies.append((time.time() - sent) * 1000)
            if as_agent:
                node.failures = node.failures + 1 if kind else 0
                at = time.time() + backoff_s(interval, node.failures)
                continue
            at += interval
            while at < time.time() - interval:  # a beat that fell a whole interval behind
                at += interval

    await asyncio.gather(*(one(i, n) for i, n in enumerate(nodes)))
    watched = {"held": sum(n.watcher is not None for n in nodes), "answered": 0, "failed": 0}
    for n in nodes:
        n.close()
        if n.watcher is not None:
            n.watcher.cancel()
            watched["answered"] += n.watched["answered"]
            watched["failed"] += n.watched["failed"]
    return {"latencies": latencies, "failures": failures, "sent": beats["sent"],
            "watched": watched}


def generator(args: dict[str, Any], out: Any) -> None:
    """One load-generator process: makes its nodes' certificates, then beats."""
    ca = pki.load_pair(args["pki"], "ca")
    folder = Path(args["dir"])
    nodes = []
    for name in args["names"]:
        cert, key = pki.issue_client(ca, name, days=1).write(folder, name)
        ctx = ssl.create_default_context(cafile=str(Path(args["pki"]) / "ca.pem"))
        ctx.load_cert_chain(cert, key)
        nodes.append(Node(name, ctx, args["port"], args["keep"], args.get("watch", False)))
    # uvloop where installed: the load generator should cost less CPU than what it measures.
    loop = new_event_loop()
    try:
        loop.run_until_complete(beats(nodes, args, out))
    finally:
        loop.close()


async def connect_all(nodes: list[Node]) -> int:
    """Open every kept-alive connection before the clock starts; returns the failures."""
    gate = asyncio.Semaphore(50)

    async def one(node: Node) -> bool:
        async with gate:
            try:
                await asyncio.wait_for(node.connect(), TIMEOUT_S)
                return True
            except Exception:  # counted; the node tries again on its first beat
                node.close()
                return False

    return sum(not ok for ok in await asyncio.gather(*(one(n) for n in nodes)))


async def beats(nodes: list[Node], args: dict[str, Any], out: Any) -> None:
    failed = await connect_all(nodes) if args["keep"] else 0
    # The generator's own full collections over thousands of connections would show up
    # as server latency: freeze what exists now, as the control plane sweeps rarely too.
    gc.collect()
    gc.freeze()
    out.send(failed)
    start = await asyncio.get_running_loop().run_in_executor(None, out.recv)
    interval = args["interval"]
    # The first interval is not measured: beats settle into their slots.
    out.send(await run_nodes(nodes, interval, start, start + interval,
                             start + interval + args["duration"], args["as_agent"]))


def start_generators(cp: ControlPlane, names: list[str], keep: bool, interval: float,
                     duration: float, procs: int, work: Path, as_agent: bool = False,
                     watch: bool = False) -> tuple[list[Any], list[Any], int, float]:
    """The load processes, their nodes connected; returns (pipes, children, nodes that
    failed to connect, the time the beats start)."""
    folders = [work / f"gen-{keep}-{as_agent}-{watch}-{len(names)}-{p}" for p in range(procs)]
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
    return start_children(generator, [{
        "pki": str(cp.pki), "dir": str(folder), "names": names[p::procs],
        "port": cp.ports["agent"], "keep": keep, "interval": interval,
        "duration": duration, "as_agent": as_agent, "watch": watch}
        for p, folder in enumerate(folders)])


def start_children(target: Any, each: list[dict[str, Any]],
                   ) -> tuple[list[Any], list[Any], int, float]:
    """A load process per dict in each, running target(that dict, its pipe end); once all
    have connected their nodes, the time the beats start is sent to each. Returns (pipes,
    children, nodes that failed to connect, that time)."""
    pipes, children = [], []
    for args in each:
        mine, theirs = multiprocessing.Pipe()
        child = multiprocessing.Process(target=target, args=(args, theirs))
        child.start()
        pipes.append(mine)
        children.append(child)
    connect_failures = sum(pipe.recv() for pipe in pipes)
    start = time.time() + 1.0
    for pipe in pipes:
        pipe.send(start)
    return pipes, children, connect_failures, start


def collect(pipes: list[Any], children: list[Any],
            watched: dict[str, int] | None = None) -> tuple[list[float], dict[str, int]]:
    """Every generator's latencies (sorted) and failures by kind (and into watched, what
    their watches did)."""
    results = [pipe.recv() for pipe in pipes]
    for child in children:
        child.join()
    failures: dict[str, int] = {}
    for r in results:
        for kind, n in r["failures"].items():
            failures[kind] = failures.get(kind, 0) + n
        if watched is not None:
            for k, n in r.get("watched", {}).items():
                watched[k] = watched.get(k, 0) + n
    return sorted(x for r in results for x in r["latencies"]), failures


def rss_mb(pid: int) -> float:
    """A process's resident memory (VmRSS) in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run(cp: ControlPlane, total: int, keep: bool, interval: float, duration: float,
        procs: int, work: Path, watch: bool = False) -> dict[str, Any]:
    kind = "w" if watch else "k" if keep else "n"
    names = [f"bench-{kind}-{total}-{i:05d}" for i in range(total)]
    rss_before = rss_mb(cp.proc.pid) if cp.proc is not None else float("nan")
    pipes, children, connect_failures, start = start_generators(
        cp, names, keep, interval, duration, procs, work, watch=watch)
    threads, cpu, rss = 0, [0.0, 0.0], 0.0
    time.sleep(max(0.0, start + interval - time.time()))
    cpu[0] = cp.cpu_s()
    while time.time() < start + interval + duration:
        threads = max(threads, cp.threads())
        if cp.proc is not None:
            rss = max(rss, rss_mb(cp.proc.pid))
        time.sleep(min(1.0, max(0.0, start + interval + duration - time.time())))
    cpu[1] = cp.cpu_s()
    watched: dict[str, int] = {}
    latencies, failures = collect(pipes, children, watched)
    return {
        "nodes": total, "mode": "watch" if watch else "keepalive" if keep else "new",
        "rss_mb": rss, "rss_before_mb": rss_before, "watched": watched,
        "offered": total / interval, "achieved": len(latencies) / duration,
        "failed": sum(failures.values()), "failures": failures,
        "p50": _pct(latencies, 50), "p99": _pct(latencies, 99), "threads": threads,
        "connect_failures": connect_failures,
        "cpu_us": (cpu[1] - cpu[0]) / max(len(latencies), 1) * 1e6,
        "cpu_share": (cpu[1] - cpu[0]) / duration,
        "load": os.getloadavg()[0],
    }


def node_states(cp: ControlPlane, prefix: str) -> tuple[int, list[float]]:
    """(nodes the control plane counts not_ready, the last_seen of each named prefix…),
    from its /metrics: lighter on it than the admin API's validated node list."""
    with cp.admin_client() as admin:
        text = admin.metrics()
    now = time.time()
    not_ready, last_seen = 0, []
    for line in text.splitlines():
        if line.startswith("llmgw_node_heartbeat_age_seconds{") and f'"{prefix}' in line:
            last_seen.append(now - float(line.rsplit(" ", 1)[1]))
        elif line.startswith('llmgw_nodes{state="not_ready"}'):
            not_ready = int(float(line.rsplit(" ", 1)[1]))
    return not_ready, last_seen


def restart(cp: ControlPlane, total: int, interval: float, duration: float, procs: int,
            work: Path) -> dict[str, Any]:
    """Kept-alive nodes beating as agents; the control plane restarted under them."""
    prefix = f"bench-r-{total}-"
    names = [f"{prefix}{i:05d}" for i in range(total)]
    duration = max(duration, RESTART_AFTER_S + BACK_WITHIN_S)
    pipes, children, connect_failures, start = start_generators(
        cp, names, True, interval, duration, procs, work, as_agent=True)
    time.sleep(max(0.0, start + interval + RESTART_AFTER_S - time.time()))
    not_ready, _ = node_states(cp, prefix)
    stopped = time.time()
    cp.stop()
    cp.start()
    up = time.time()
    cpu0, back_s, seen = cp.cpu_s(), float("nan"), 0
    while time.time() < up + BACK_WITHIN_S:
        shown, last_seen = node_states(cp, prefix)
        not_ready = max(not_ready, shown)
        seen = sum(t >= up for t in last_seen)
        if seen == total:
            back_s = time.time() - up
            break
        time.sleep(max(0.0, 1.0 - (time.time() - up) % 1.0))
    cpu = cp.cpu_s() - cpu0
    for _ in range(3):  # and after: a node the grace held must not drop afterwards
        not_ready = max(not_ready, node_states(cp, prefix)[0])
        time.sleep(1.0)
    latencies, failures = collect(pipes, children)
    return {"nodes": total, "down_s": up - stopped, "not_ready": not_ready,
            "back_s": back_s, "back": seen, "failures": failures,
            "cpu_ms": cpu / max(seen, 1) * 1e3, "p99": _pct(latencies, 99),
            "connect_failures": connect_failures}


def print_restart(r: dict[str, Any]) -> None:
    kinds = ", ".join(f"{n} {k}" for k, n in r["failures"].items()) or "none"
    back = (f"{r['back_s']:.1f} s" if r["back_s"] == r["back_s"]
            else f"not all: {r['back']:,} in {BACK_WITHIN_S:.0f} s")
    print(f"| {r['nodes']:,} | {r['down_s']:.1f} s | {r['not_ready']} | {back} | "
          f"{r['cpu_ms']:.2f} ms | {kinds} | {r['p99']:.0f} |", flush=True)


# spread mode: the phases, in seconds from the first beat. Nodes reach their homes within
# a beat plus the return spread; the second control plane is stopped longer than the node
# timeout (its row goes stale, the answers stop naming it), then started again.
SPREAD_SETTLE_S = 75.0
SPREAD_MEASURE_S = 30.0
SPREAD_DOWN_S = 40.0
SPREAD_BACK_S = 90.0
FAILOVER_S = AgentConfig.model_fields["failover_timeout_s"].default


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """An answer's status and body."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return int(head.split(b" ", 2)[1]), await reader.readexactly(length)


class SpreadNode(Node):
    """A node that beats as the agent does to several control planes: it learns them from
    the answers, goes home when its return delay has passed, and on no answer within
    FAILOVER_S moves to the next in its order (the agent's ControlPlanes decides each)."""

    def __init__(self, name: str, ctx: ssl.SSLContext, server: str, state_dir: Path) -> None:
        super().__init__(name, ctx, int(server.rsplit(":", 1)[1]), True)
        self.planes = ControlPlanes(server, state_dir, name)

    def move(self, url: str) -> None:
        self.close()
        self.port = int(url.rsplit(":", 1)[1])
        self.planes.use(url)

    async def beat_spread(self) -> tuple[str, str]:
        """One heartbeat: the URL of the control plane that answered it, and how the node
        came to it if it moved ("home": its return delay passed; "failover": the one before
        did not answer); OSError naming why the last one tried did not, when none did."""
        home = self.planes.due_home(time.monotonic())
        how = ""
        if home is not None:
            self.move(home)
            how = "home"
        why = ""
        for _ in range(len(self.planes.order)):
            try:
                status, body = await asyncio.wait_for(self.answer(), FAILOVER_S)
                if status == 200:
                    self.planes.learn(json.loads(body))
                    return self.planes.current, how
                why = f"HTTP {status}"
            except (OSError, TimeoutError, asyncio.IncompleteReadError, ssl.SSLError) as e:
                why = type(e).__name__
            self.planes.left(self.planes.current, time.monotonic())
            self.move(self.planes.next_after(self.planes.current))
            how = "failover"
        raise OSError(why)

    async def answer(self) -> tuple[int, bytes]:
        """A beat on the kept-alive connection, made again once if the server dropped it."""
        for again in (False, True):
            try:
                reader, writer = await self.connect()
                writer.write(self.payload)
                return await read_answer(reader)
            except (OSError, asyncio.IncompleteReadError, ssl.SSLError):
                self.close()
                if again:
                    raise
        raise AssertionError("unreachable")


async def spread_beats(nodes: list[SpreadNode], urls: list[str], interval: float,
                       start: float, end: float) -> list[tuple[float, int, int, str]]:
    """Every beat of nodes from start to end: (time answered, node index, index in urls of
    the control plane that answered or -1 when none did; how the node came to the one that
    answered, or why the last one tried did not)."""
    events: list[tuple[float, int, int, str]] = []
    index = {u: i for i, u in enumerate(urls)}

    async def one(i: int, node: SpreadNode) -> None:
        at = start + interval * i / len(nodes)
        while at < end:
            await asyncio.sleep(max(0.0, at - time.time()))
            try:
                url, note = await node.beat_spread()
                answered = index.get(url, -1)
                node.failures = 0
            except OSError as e:
                answered, note = -1, str(e)
                node.failures += 1
            events.append((time.time(), i, answered, note))
            at = time.time() + backoff_s(interval, node.failures)

    await asyncio.gather(*(one(i, n) for i, n in enumerate(nodes)))
    for n in nodes:
        n.close()
    return events


def spread_generator(args: dict[str, Any], out: Any) -> None:
    """One load-generator process of spread mode: its nodes, then their beats' events."""
    ca = pki.load_pair(args["pki"], "ca")
    folder = Path(args["dir"])
    # Each node keeps what it learned as the agent does (an fsynced write each): in memory,
    # as 2,000 machines' own disks would not queue behind one another.
    states = Path(tempfile.mkdtemp(prefix="llmgw-bench-nodes-",
                                   dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    nodes = []
    for name in args["names"]:
        cert, key = pki.issue_client(ca, name, days=1).write(folder, name)
        ctx = ssl.create_default_context(cafile=str(Path(args["pki"]) / "ca.pem"))
        ctx.load_cert_chain(cert, key)
        nodes.append(SpreadNode(name, ctx, args["urls"][0], states / name))
    loop = new_event_loop()

    async def beat() -> None:
        out.send(await connect_all(list(nodes)))
        start = await asyncio.get_running_loop().run_in_executor(None, out.recv)
        out.send(await spread_beats(nodes, args["urls"], args["interval"], start,
                                    start + args["end"]))

    try:
        loop.run_until_complete(beat())
    finally:
        loop.close()
        shutil.rmtree(states, ignore_errors=True)


def fleet_of_two(work: Path, store: str) -> list[ControlPlane]:
    """Two control planes on store, one fleet: the second gets the first's CA (with its
    key) and loopback server certificate, as `pytest provision/ --join ... --control-plane`
    gives a second host the fleet's CA."""
    first = ControlPlane(work / "spread-a", store=store)
    (work / "spread-b" / "pki").mkdir(parents=True)
    for name in ("ca.pem", "ca-key.pem", "server.pem", "server-key.pem"):
        (work / "spread-b" / "pki" / name).write_bytes((first.pki / name).read_bytes())
    return [first.start(), ControlPlane(work / "spread-b", store=store).start()]


def spread(total: int, interval: float, procs: int, work: Path) -> dict[str, Any]:
    """Two control planes on one PostgreSQL store, total nodes spread over them; the
    second stopped after SPREAD_SETTLE_S + SPREAD_MEASURE_S, started SPREAD_DOWN_S later."""
    binaries = bindir()
    if binaries is None:
        raise SystemExit("spread mode needs PostgreSQL's server binaries (Debian: "
                         "apt-get install postgresql); none found by pg_config or under "
                         "/usr/lib/postgresql")
    pg = PostgresServer(binaries)
    pg.start()
    cps: list[ControlPlane] = []
    try:
        cps = fleet_of_two(work, pg.create_database())
        return _spread_run(cps, total, interval, procs, work)
    finally:
        for cp in cps:
            cp.stop()
        pg.remove()


def _spread_run(cps: list[ControlPlane], total: int, interval: float, procs: int,
                work: Path) -> dict[str, Any]:
    a, b = cps
    urls = [a.agent_api, b.agent_api]
    prefix = f"bench-s-{total}-"
    names = [f"{prefix}{i:05d}" for i in range(total)]
    end = SPREAD_SETTLE_S + SPREAD_MEASURE_S + SPREAD_DOWN_S + SPREAD_BACK_S
    pipes, children, connect_failures, start = start_children(spread_generator, [{
        "pki": str(a.pki), "dir": str(work / f"spread-gen-{p}"), "names": names[p::procs],
        "urls": urls, "interval": interval, "end": end} for p in range(procs)])
    time.sleep(max(0.0, start + SPREAD_SETTLE_S + SPREAD_MEASURE_S - time.time()))
    stopped = time.time()
    b.stop()
    not_ready = 0
    while time.time() < stopped + SPREAD_DOWN_S:
        not_ready = max(not_ready, node_states(a, prefix)[0])
        time.sleep(1.0)
    b.start()
    up = time.time()
    while time.time() < start + end:
        not_ready = max(not_ready, node_states(a, prefix)[0])
        time.sleep(1.0)
    events = [e for pipe in pipes for e in pipe.recv()]
    for child in children:
        child.join()
    return {"nodes": total, "start": start, "stopped": stopped, "up": up,
            "not_ready": not_ready, "events": sorted(events), "interval": interval,
            "connect_failures": connect_failures}


def spread_figures(r: dict[str, Any]) -> dict[str, Any]:
    """The figures of a spread run from its events."""
    events, start, stopped, up = r["events"], r["start"], r["stopped"], r["up"]
    measured = [cp for t, _, cp, _ in events
                if start + SPREAD_SETTLE_S <= t < start + SPREAD_SETTLE_S + SPREAD_MEASURE_S]
    shares = [measured.count(i) / max(len(measured), 1) for i in (0, 1)]
    last: dict[int, tuple[float, int]] = {}
    for t, node, cp, _ in events:
        if t < stopped and cp >= 0:
            last[node] = (t, cp)
    at_b = {n for n, (_, cp) in last.items() if cp == 1}
    # How long each of them went unheard: its last answer before the stop to its next.
    gaps, came_back = {}, {}
    for t, node, cp, how in events:
        if node in at_b and cp >= 0 and t > last[node][0] and node not in gaps:
            gaps[node] = t - last[node][0]
        if node in at_b and cp == 1 and t >= up and node not in came_back:
            came_back[node] = (t - up, how)
    tail = [cp for t, _, cp, _ in events if t >= up + SPREAD_BACK_S - 20]
    back_at = sorted(t for t, _ in came_back.values())
    phases = {"before the stop": (start, stopped), "while b was down": (stopped, up),
              "after b was back": (up, float("inf"))}
    return {
        "shares": shares, "at_b": len(at_b),
        "gap_max": max(gaps.values(), default=float("nan")),
        "failed": Counter(why for _, _, cp, why in events if cp < 0),
        "failed_when": {name: sum(cp < 0 and a <= t < b for t, _, cp, _ in events)
                        for name, (a, b) in phases.items()},
        "back_how": Counter(how or "stayed" for _, how in came_back.values()),
        "back": len(back_at) / max(len(at_b), 1),
        "back_by": [sum(x < s for x in back_at) / max(len(at_b), 1) for s in (10, 20, 30,
                                                                             60, 90)],
        "most_in_10s": max((sum(w <= x < w + 10 for x in back_at) for w in range(0, 90)),
                           default=0) / max(len(at_b), 1),
        "back_first_s": back_at[0] if back_at else float("nan"),
        "back_last_s": back_at[-1] if back_at else float("nan"),
        "end_share_b": tail.count(1) / max(len(tail), 1),
    }


def print_spread(r: dict[str, Any]) -> None:
    f = spread_figures(r)
    by = " / ".join(f"{x:.0%}" for x in f["back_by"])
    print(f"| {r['nodes']:,} | {f['shares'][0]:.1%} / {f['shares'][1]:.1%} | {f['at_b']:,} | "
          f"{f['gap_max']:.1f} s (limit {FAILOVER_S + r['interval']:.0f} s) | "
          f"{r['not_ready']} | {f['back']:.0%}: {by} | {f['most_in_10s']:.0%} | "
          f"{f['back_first_s']:.0f}–{f['back_last_s']:.0f} s | {f['end_share_b']:.1%} | "
          f"{sum(f['failed'].values())}"
          + (f" ({', '.join(f'{n} {k}' for k, n in f['failed'].items())}; "
             + ", ".join(f"{n} {k}" for k, n in f["failed_when"].items()) + ")"
             if f["failed"] else "") + " |", flush=True)
    print("  b's nodes came back to it by: "
          + ", ".join(f"{k} {n}" for k, n in f["back_how"].items()), flush=True)


def _pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(p) - 1]


def against_record(r: dict[str, Any], recorded: dict[str, Any]) -> str:
    """The row's CPU a beat and p99 beside the recorded ones, and plainly when CPU a beat
    grew by more than GROWN_AT."""
    was = recorded.get(r["mode"], {}).get(str(r["nodes"]))
    if was is None:
        return "no recorded figures for this row"
    grown = r["cpu_us"] / was["cpu_us"] - 1
    line = (f"CPU a beat {r['cpu_us']:.0f} µs against {was['cpu_us']:.0f} µs recorded "
            f"({grown:+.0%}), p99 {r['p99']:.1f} ms against {was['p99']:g} ms")
    if grown > GROWN_AT:
        line += (f"; REGRESSION: CPU a beat grew by more than {GROWN_AT:.0%} over the "
                 "record: profile the heartbeat path (bench/README.md) before merging")
    return line


def print_row(r: dict[str, Any], side: str, recorded: dict[str, Any]) -> None:
    kinds = ", ".join(f"{n} {k}" for k, n in r["failures"].items())
    print(f"| {side} | {r['nodes']:,} | {r['mode']} | {r['offered']:.0f} | "
          f"{r['achieved']:.0f} | {r['failed']}{f' ({kinds})' if kinds else ''}"
          f" | {r['p50']:.1f} | {r['p99']:.1f} | {r['threads']} | "
          f"{r['cpu_us']:.0f} µs | {r['cpu_share']:.2f} | {r['load']:.1f} |"
          + (f" ({r['connect_failures']} failed to connect before the clock)"
             if r["connect_failures"] else ""), flush=True)
    held = r.get("watched") or {}
    print(f"|   | {side}: control plane RSS {r['rss_mb']:.0f} MB at most while measured "
          f"({r['rss_before_mb']:.0f} MB before the row)"
          + (f"; watches held {held.get('held', 0)}, answered {held.get('answered', 0)}, "
             f"failed {held.get('failed', 0)}" if r["mode"] == "watch" else "") + " |",
          flush=True)
    print(f"|   | {side}: {against_record(r, recorded)} |", flush=True)


def settle(cp: ControlPlane, within_s: float = 60.0) -> None:
    """Until the control plane is about idle again (under 20 % of a core for a second; its
    scheduler still reads every node each second): one that fell behind still answers
    beats nobody waits for, and would load the next row."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        before = cp.cpu_s()
        time.sleep(1.0)
        if cp.cpu_s() - before < 0.2:
            return
    print(f"# the control plane was still busy {within_s:.0f} s after its row", flush=True)


def _only_keys_known_to(src: str, server_yaml: Path) -> None:
    """server.yaml as the older checkout reads it: this checkout's settings that its
    ServerConfig does not know (all at their defaults here) left out, as an upgrade would
    find the file."""
    known = json.loads(subprocess.run(
        [sys.executable, "-c", "import json; from llmgw.config import ServerConfig; "
         "print(json.dumps(list(ServerConfig.model_fields)))"],
        env={**os.environ, "PYTHONPATH": str(Path(src).resolve())}, check=True,
        capture_output=True, text=True).stdout)
    settings = yaml.safe_load(server_yaml.read_text())
    server_yaml.write_text(yaml.safe_dump({k: v for k, v in settings.items() if k in known},
                                          sort_keys=False))


def control_plane(root: Path, src: str = "") -> ControlPlane:
    """A started control plane in root: this checkout's, or the one whose src is src."""
    if not src:
        return ControlPlane(root).start()
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(src).resolve()), before)
                                               if p)
    try:
        cp = ControlPlane(root)
        _only_keys_known_to(src, cp.server_yaml)
        return cp.start()  # its processes keep the environment they got
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", default="1000,2000,5000", help="comma-separated node counts")
    parser.add_argument("--modes", default="keepalive,new",
                        help="keepalive, new, watch, restart, spread, or several "
                             "comma-separated")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between beats")
    parser.add_argument("--duration", type=float, default=30.0, help="measured seconds")
    parser.add_argument("--procs", type=int, default=2, help="load-generator processes")
    parser.add_argument("--old-src", default="",
                        help="another checkout's src folder: its control plane runs each "
                             "row just before this one's")
    args = parser.parse_args()
    if args.old_src and not (Path(args.old_src) / "llmgw").is_dir():
        sys.exit(f"--old-src {args.old_src} holds no llmgw package: name a checkout's src "
                 "folder (`git worktree add ../old main`, then ../old/src)")
    recorded = json.loads(RECORDED.read_text())
    print(f"# heartbeats every {args.interval:g}s, measured {args.duration:g}s after one "
          f"interval of connecting; {os.cpu_count()} CPUs shared with whatever else runs; "
          f"load from {args.procs} process(es)")
    if set(args.modes.split(",")) - {"restart", "spread"}:
        print(f"# recorded ({recorded['recorded']}) in {RECORDED.name}")
        print("| control plane | nodes | mode | offered/s | achieved/s | failed | p50 ms | "
              "p99 ms | control plane threads | control plane CPU per beat | its cores busy "
              "| load average |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-") as tmp:
        cp = ControlPlane(Path(tmp) / "cp")
        if set(args.modes.split(",")) - {"spread"}:  # spread starts its own two
            cp.start()
        old = None
        try:
            if args.old_src:  # inside: a failed start still stops the control plane above
                old = control_plane(Path(tmp) / "cp-old", args.old_src)
            for mode in args.modes.split(","):
                if mode == "spread":
                    print("\n| nodes | beats to a / b | b's nodes | longest unheard when b "
                          "stopped | most shown not_ready | b's nodes back at b: after "
                          "10 / 20 / 30 / 60 / 90 s | most back in any 10 s | first–last "
                          "back | b's share at the end | beats none answered |"
                          "\n|---|---|---|---|---|---|---|---|---|---|")
                    for total in (int(n) for n in args.nodes.split(",")):
                        print_spread(spread(total, args.interval, args.procs,
                                            Path(tmp) / f"spread-{total}"))
                    continue
                if mode == "restart":
                    print("\n| nodes | control plane down | most shown not_ready | all beating "
                          "again after it answers | its CPU per node back | failed beats | "
                          "beat p99 ms |\n|---|---|---|---|---|---|---|")
                    for total in (int(n) for n in args.nodes.split(",")):
                        # A control plane of its own: no node of another run in its counts.
                        own = ControlPlane(Path(tmp) / f"cp-restart-{total}").start()
                        try:
                            print_restart(restart(own, total, args.interval, args.duration,
                                                  args.procs, Path(tmp)))
                        finally:
                            own.stop()
                    continue
                for total in (int(n) for n in args.nodes.split(",")):
                    sides = [("old", old), ("this", cp)] if old is not None else [("this", cp)]
                    for side, plane in sides:
                        r = run(plane, total, mode in ("keepalive", "watch"), args.interval,
                                args.duration, args.procs, Path(tmp) / side,
                                watch=mode == "watch")
                        print_row(r, side, recorded)
                        settle(plane)
        finally:
            cp.stop()
            if old is not None:
                old.stop()


if __name__ == "__main__":
    main()
