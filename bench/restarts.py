"""Requests lost across restarts: the control plane's, then the gateway's, under load.

Run on demand, not in the suite:
    python bench/restarts.py [--duration 20] [--concurrency 8] [--keep DIR]

Provisions a throwaway local-mode host (tests/hosts.py: `pytest provision/` for real, on
free loopback ports, the tests' tiny GGUF as the starter, the cached llama-server), then
runs two rounds of `hey -c CONCURRENCY -z DURATION` (chat completions through the
gateway; the bench's own bounded Python load generator where hey is absent):
  1. the control plane restarted (supervisord stop + start of llmgw-server) a quarter in;
  2. the gateway handed over twice (its provisioning's reload: SIGHUP, a new worker on
     the same socket, the old one drains), a quarter and three quarters in.
With --control, a third round is the negative control: the gateway restarted the plain way
(supervisord stop + start), which refuses connections meanwhile; it is printed, not summed.
Each round prints its answers by status and its errors by kind; the last line sums the
first two.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from llmgw.host.services._supervisor import Supervisor  # noqa: E402
from tests.hosts import ThrowawayHost  # noqa: E402
from tests.tiny_gguf import write_tiny_gguf  # noqa: E402

BODY = '{"model": "qwen-0.5b", "messages": [{"role": "user", "content": "hi"}], ' \
       '"max_tokens": 4}'


def hey(url: str, key: str, concurrency: int, duration_s: float
        ) -> tuple[Counter[str], Counter[str]]:
    """(answers by status, errors by kind) from one hey run, with the gateway key."""
    proc = subprocess.run(
        ["hey", "-c", str(concurrency), "-z", f"{duration_s:.0f}s", "-m", "POST",
         "-T", "application/json", "-H", f"Authorization: Bearer {key}", "-d", BODY, url],
        capture_output=True, text=True, timeout=duration_s + 60)
    statuses: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    section = ""
    for line in proc.stdout.splitlines():
        if line.startswith("Status code distribution"):
            section = "status"
        elif line.startswith("Error distribution"):
            section = "errors"
        elif m := re.match(r"\s+\[(\d+)\]\s+(\d+) responses", line):
            if section == "status":
                statuses[m.group(1)] += int(m.group(2))
        elif section == "errors" and (m := re.match(r"\s+\[(\d+)\]\s+(.*)", line)):
            errors[_kind(m.group(2))] += int(m.group(1))
    if not statuses and not errors:
        raise RuntimeError(f"hey printed no distribution ({proc.returncode}): "
                           f"{proc.stdout[-500:]} {proc.stderr[-500:]}")
    return statuses, errors


def python_load(url: str, key: str, concurrency: int,
                duration_s: float) -> tuple[Counter[str], Counter[str]]:
    """hey's two counts from threads with keep-alive clients, bounded by duration_s and
    20,000 requests each."""
    statuses: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    lock = threading.Lock()
    deadline = time.monotonic() + duration_s

    def client() -> None:
        with httpx.Client(timeout=30) as c:
            for _ in range(20_000):
                if time.monotonic() > deadline:
                    return
                try:
                    r = c.post(url, content=BODY, headers={"Content-Type": "application/json",
                                                           "Authorization": f"Bearer {key}"})
                    with lock:
                        statuses[str(r.status_code)] += 1
                except httpx.HTTPError as e:
                    with lock:
                        errors[_kind(f"{type(e).__name__}: {e}")] += 1
                    time.sleep(0.001)

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(duration_s + 60)
    return statuses, errors


def _kind(error: str) -> str:
    for kind in ("connection refused", "connection reset", "EOF", "timeout",
                 "ConnectError", "RemoteProtocolError", "ReadError"):
        if kind.lower() in error.lower():
            return kind
    return error[-80:]


def wait_answering(url: str, timeout_s: float = 60.0) -> float:
    """Seconds until url answers 200."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not answer within {timeout_s:.0f} s")


def round_(name: str, load: Callable[[], tuple[Counter[str], Counter[str]]],
           actions: list[tuple[float, Callable[[], str]]]) -> tuple[int, int, int]:
    """Run load while actions fire at their times; print and return (answers, non-200,
    errors)."""
    said: list[str] = []

    def fire() -> None:
        started = time.monotonic()
        for at, action in actions:
            time.sleep(max(0.0, at - (time.monotonic() - started)))
            said.append(action())

    actor = threading.Thread(target=fire)
    actor.start()
    statuses, errors = load()
    actor.join(120)
    ok = statuses.get("200", 0)
    non200 = sum(statuses.values()) - ok
    failed = sum(errors.values())
    print(f"{name}: {ok} answers 200, {non200} non-200 {dict(statuses)}, {failed} "
          f"connection errors {dict(errors)}; {'; '.join(said)}", flush=True)
    return ok, non200, failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per round")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--control", action="store_true",
                        help="also restart the gateway the plain way (it should lose some)")
    parser.add_argument("--keep", default=None, metavar="DIR",
                        help="make the host in DIR and leave its files (it is stopped)")
    args = parser.parse_args()
    work = Path(args.keep or tempfile.mkdtemp(prefix="llmgw-restarts-"))
    work.mkdir(parents=True, exist_ok=True)
    gguf = work / "tiny.gguf"
    write_tiny_gguf(gguf)
    host = ThrowawayHost(work / "host")
    try:
        return bench(host, gguf, args)
    finally:
        print(host.down().strip(), flush=True)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def bench(host: ThrowawayHost, gguf: Path, args: argparse.Namespace) -> int:
    print(f"provisioning a throwaway host in {host.state_dir} ...", flush=True)
    run = host.provision(f"--starter-source={gguf.as_uri()}")
    if run.returncode != 0:
        print(run.output[-3000:])
        return 1
    url = f"http://127.0.0.1:{host.ports['gateway']}/v1/chat/completions"
    admin = f"{host.admin_url}/healthz"
    supervisor = Supervisor(host.state_dir)
    tool = "hey" if shutil.which("hey") else "python"
    print(f"load: {tool} -c {args.concurrency} for {args.duration:.0f} s per round, {url}",
          flush=True)

    # The owner's key: provisioning makes every request need one (gateway_keys: required).
    key = host.gateway_key

    def load() -> tuple[Counter[str], Counter[str]]:
        if tool == "hey":
            return hey(url, key, args.concurrency, args.duration)
        return python_load(url, key, args.concurrency, args.duration)

    def restart_control_plane() -> str:
        started = time.monotonic()
        supervisor.restart("llmgw-server")
        wait_answering(admin)
        return (f"llmgw-server restarted; its admin API answered again "
                f"{time.monotonic() - started:.2f} s after the restart began")

    def reload_gateway() -> str:
        before = gateway_workers(host)
        started = time.monotonic()
        supervisor.reload("llmgw-gateway")
        while gateway_workers(host) == before and time.monotonic() - started < 30:
            time.sleep(0.05)
        return f"gateway handed over to a new worker in {time.monotonic() - started:.2f} s"

    quarter = args.duration / 4
    rounds = [
        round_("control plane restart", load, [(quarter, restart_control_plane)]),
        round_("gateway restart", load, [(quarter, reload_gateway),
                                         (3 * quarter, reload_gateway)]),
    ]
    if args.control:
        def restart_gateway() -> str:
            started = time.monotonic()
            supervisor.restart("llmgw-gateway")
            return f"llmgw-gateway restarted (stop, start) in {time.monotonic() - started:.2f} s"

        round_("negative control, gateway stopped and started", load,
               [(quarter, restart_gateway)])
    ok = sum(r[0] for r in rounds)
    non200 = sum(r[1] for r in rounds)
    failed = sum(r[2] for r in rounds)
    print(f"restarts: {ok} answers, {non200} non-200, {failed} connection errors "
          f"(control plane restart, then 2 gateway handovers; {tool} -c {args.concurrency}, "
          f"{args.duration:.0f} s each)", flush=True)
    return 0 if non200 == failed == 0 else 1


def gateway_workers(host: ThrowawayHost) -> int:
    """How many workers the gateway's log says started serving."""
    log = Supervisor(host.state_dir).logs / "llmgw-gateway.log"
    return log.read_text(errors="replace").count(" serves ") if log.exists() else 0


if __name__ == "__main__":
    sys.exit(main())
