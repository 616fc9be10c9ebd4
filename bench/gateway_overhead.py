"""What the gateway costs a chat completion, direct and through it side by side in one run.

Run on demand, not in the suite:

    python bench/gateway_overhead.py [--seconds 3] [--pairs 15]      # its own engine and gateway
    python bench/gateway_overhead.py --old-src ../old/src            # and an older checkout's
    python bench/gateway_overhead.py --host [--state-dir DIR]        # a provisioned host's

By default it serves the tests' tiny GGUF with the real llama-server (a few ms per 8-token
answer, so the gateway's own cost is visible) and the real gateway app in its own process,
served as `llmgw server` serves it. With --host it measures what a provisioned host runs:
its `llmgw server` (the gateway in server.yaml, with its first token) against the engine
of a ready replica on this machine, called directly with the replica's own key from the
control plane's database (read-only; run as the user who provisioned, or root).

A third side is nginx (apt install nginx) as a plain reverse proxy in front of the same
engine: upstream keep-alive, no buffering, the replica's key set by the proxy as the gateway
sets it; the bench writes its nginx.conf in a temporary folder and runs it as its child,
one process (master_process off, as one gateway process), on loopback. --no-nginx leaves
it out.

With --old-src, another checkout's gateway (its src folder: `git worktree add ../old
main` makes one) is a side too, served the same way over the same store and engine in the
same rounds, so a change to the gateway is measured against the code before it:
`gateway/old` is new over old.

A fourth side is LiteLLM's proxy (the Python gateway users pick instead), fronting the same
engine: one worker, a master key, the engine as an `openai/...` model of its config's
model_list, LITELLM_LOCAL_MODEL_COST_MAP=True (no price list fetched), its defaults
otherwise. It is never installed into the project's venv: the bench uses
$LLMGW_BENCH_LITELLM (a `litellm` executable) or ~/.cache/llmgw-bench/litellm-venv, and
makes that venv (`pip install 'litellm[proxy]'`) the first time; the first lines say
which. --no-litellm leaves it out.

A side "limited" is the same gateway sent a gateway key with an rpm and a tpm it never
reaches (10^9 and 10^12): what it adds is the key's share of its minute, spent in memory,
claimed from and settled with the store in the background (gateway/_budgets.py);
`limited/gateway` is its throughput over the same gateway's without a key (with --old-src,
`old-limited` is the older gateway sent the same key). --no-limited leaves it out.

Each side's own CPU per request is its process's user + system time (/proc/PID/stat)
over a round, divided by the requests answered in it.

It loads the sides at 1 and at 16 requests in flight in --pairs short rounds (direct,
gateway and nginx back to back, each first in turn) and reports the median of the rounds'
ratios: on a shared, noisy machine the load drifts from second to second, and sides
measured back to back see nearly the same drift. The load comes from `hey` where it is
installed (apt install hey), else from a Python generator in its own process; the first
line printed says which. The last line is:

    gateway/nginx 0.NNx at 1, 0.NNx at 16; gateway/LiteLLM N.NNx at 1, N.NNx at 16; CPU \
per request ms: gateway A, nginx B, LiteLLM C

(throughput ratios, medians of the rounds; CPU: the side's own process at 16 in flight)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import resource
import secrets
import shlex
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._engine import llama_server, wait_ok  # noqa: E402
from llmgw.config import connect_host, load_server  # noqa: E402

try:  # this checkout's layout (a package per process: issue 41)
    from llmgw.contract import keys
    from llmgw.gateway._upstream import Upstream
    from llmgw.gateway.app import make_gateway_app
    from llmgw.gateway.metrics import GatewayMetrics
    from llmgw.host.layout import Layout
    from llmgw.host.netaddr import free_port
    from llmgw.http1.server import Http1Server
    from llmgw.model.engine_args import HTTP_THREADS
    from llmgw.store import Store
except ImportError:  # --old-src's gateway process, on a checkout from before it
    from llmgw._http1 import Http1Server  # type: ignore[no-redef]
    from llmgw.control._upstream import Upstream  # type: ignore[no-redef]
    from llmgw.control.gateway import make_gateway_app  # type: ignore[no-redef]
    from llmgw.control.store import Store  # type: ignore[no-redef]
    from llmgw.engine_args import HTTP_THREADS  # type: ignore[no-redef]
    from llmgw.layout import Layout  # type: ignore[no-redef]
    from llmgw.netaddr import free_port  # type: ignore[no-redef]

    from llmgw.control import keys  # type: ignore[no-redef]
    from llmgw.control.metrics import GatewayMetrics  # type: ignore[no-redef]
from tests.procs import cpu_s, listener_pid  # noqa: E402
from tests.tiny_gguf import write_tiny_gguf  # noqa: E402

WIDTHS = (1, 16)
# The limited side's key: limits it never reaches, so every request is answered and what is
# measured is the bookkeeping of its shares.
LIMITED_RPM, LIMITED_TPM = 10**9, 10**12


def request_body(model: str) -> str:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 8, "temperature": 0})


@dataclass(frozen=True)
class Side:
    """One way to a chat completion: its URL, the bearer key it takes, and the process
    whose CPU it costs (0 when not known)."""

    url: str
    key: str
    pid: int


@dataclass
class Run:
    rps: float
    p50_ms: float
    non_200: int
    count: int = 0
    # CPU ms per request, by process (engine, gateway, load): robust where wall time is not.
    cpu_ms: dict[str, float] | None = None


def children_cpu_s() -> float:
    """CPU seconds of this process's finished children: the load generator's runs."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def hey(side: Side, body: str, width: int, seconds: float) -> Run:
    out = subprocess.run(
        ["hey", "-z", f"{seconds}s", "-c", str(width), "-m", "POST", "-T", "application/json",
         *(["-H", f"Authorization: Bearer {side.key}"] if side.key else []), "-d", body,
         side.url],
        capture_output=True, text=True, check=True).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out)[1])
    # No latency distribution when no answer came in the time (a side that is slow to its
    # first answer, or down): the round then counts its errors instead.
    latency = re.search(r"50%+ in ([\d.]+) secs", out)
    p50 = float(latency[1]) * 1000 if latency else math.nan
    head, _, errors = out.partition("Error distribution:")
    codes = {int(c): int(n) for c, n in re.findall(r"\[(\d+)\]\s+(\d+) responses", head)}
    failed = sum(int(n) for n in re.findall(r"^\s+\[(\d+)\]", errors, re.M))
    return Run(rps, p50, sum(n for c, n in codes.items() if c != 200) + failed,
               sum(codes.values()))


async def _generate(url: str, key: str, body: str, width: int, seconds: float) -> Run:
    """The fallback generator: width keep-alive connections, each one request at a time."""
    upstream, data = Upstream(), body.encode()
    base, path = url.split("/v1/", 1)
    times: list[float] = []
    bad = 0
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal bad
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            response = await upstream.post(base, "/v1/" + path, data, key)
            await response.read()
            times.append(time.perf_counter() - start)
            bad += response.status != 200

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(width)))
    elapsed = time.perf_counter() - start
    await upstream.aclose()
    return Run(len(times) / elapsed, statistics.median(times) * 1000, bad, len(times))


def python_load(side: Side, body: str, width: int, seconds: float) -> Run:
    """The fallback generator in its own process, so it shares no GIL with anything."""
    out = subprocess.run([sys.executable, __file__, "--generate", side.url, side.key, body,
                          str(width), str(seconds)],
                         capture_output=True, text=True, check=True).stdout
    return Run(**json.loads(out))


def first_answer(name: str, side: Side, body: str) -> None:
    headers = {"Authorization": f"Bearer {side.key}"} if side.key else {}
    try:
        r = httpx.post(side.url, content=body, timeout=120,
                       headers={**headers, "Content-Type": "application/json"})
    except httpx.HTTPError as e:
        sys.exit(f"{name} at {side.url} gave no first answer in 120 s: {e!r}")
    if r.status_code != 200:
        sys.exit(f"{name} at {side.url} answered its first request {r.status_code}: "
                 f"{r.text[:500]}")


def measured(load, side: Side, body: str, width: int, seconds: float,  # type: ignore[no-untyped-def]
             pids: dict[str, int]) -> Run:
    """One load of side, with the CPU each process spent per request."""
    pids = {name: pid for name, pid in pids.items() if pid}
    before = {name: cpu_s(pid) for name, pid in pids.items()}
    load_before = children_cpu_s()
    run = load(side, body, width, seconds)
    per = max(run.count, 1)
    run.cpu_ms = {name: (cpu_s(pid) - before[name]) * 1000 / per for name, pid in pids.items()}
    run.cpu_ms["load"] = (children_cpu_s() - load_before) * 1000 / per
    return run


def fill_store(path: Path, setup: dict[str, dict[str, object]]) -> None:
    """The bench's store at path, made by the code that runs this (another checkout's may
    be of another schema revision): the model, its replica and the limited key."""
    store = Store(path)
    if not store.models():
        store.add_model(setup["model"])
        store.put_replica(setup["replica"])
        store.add_key(setup["key"])
    store.close()


def serve_gateway(work: Path, port: int) -> None:
    """The real gateway app over its own store (made from the bench's setup.json), served as
    `llmgw gateway` serves it: Http1Server with the gateway's fast handler (the Forwarder;
    in a checkout from before it, given with --old-src, the FastPath it had)."""
    from prometheus_client import CollectorRegistry

    fill_store(work / "control.db", json.loads((work.parent / "setup.json").read_text()))
    app = make_gateway_app(Store(work / "control.db"), upstream=Upstream(),
                           metrics=GatewayMetrics(CollectorRegistry()))
    try:
        try:
            from llmgw.gateway._forward import Forwarder
        except ImportError:  # --old-src: a checkout from before the package per process
            from llmgw.control._forward import Forwarder  # type: ignore[no-redef]
        fast = Forwarder(app)
    except ImportError:  # --old-src: the code before the Forwarder
        from llmgw.control._fastpath import FastPath  # type: ignore[import-not-found]
        fast = FastPath(app)
    Http1Server(app, f"127.0.0.1:{port}", fast=fast).run()


def start_gateway(work: Path, src: str = "") -> tuple[subprocess.Popen[bytes], Side]:
    """A gateway process over a store of its own in work/new or work/old: this checkout's,
    or the one whose src folder is src."""
    port = free_port()
    work = work / ("old" if src else "new")
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(Path(src).resolve()) if src else "",
                    os.environ.get("PYTHONPATH", "")) if p)}
    gateway = subprocess.Popen([sys.executable, __file__, "--serve-gateway", str(work),
                                str(port)], env=env)
    wait_ok(f"http://127.0.0.1:{port}/healthz")
    return gateway, Side(f"http://127.0.0.1:{port}/v1/chat/completions", "", gateway.pid)


def start_own(work: Path, width: int, engine_args: list[str]
              ) -> tuple[list[subprocess.Popen[bytes]], Side, Side, str]:
    """A llama-server on the tiny GGUF and a gateway in front of it, both started here.

    The engine gets the HTTP threads the control plane gives replicas: with llama-server's
    default (slots + 2) the keep-alive connections one side left open (nginx's, the
    gateway's pool) held threads for the engine's 5 s idle timeout, and the next side's
    connections waited unserved (and the gateway's /slots poll timed out)."""
    gguf = work / "tiny.gguf"
    write_tiny_gguf(gguf)
    key, engine_port = secrets.token_urlsafe(16), free_port()
    engine = subprocess.Popen(
        [llama_server(), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(engine_port),
         "--api-key", key, "--metrics", "--ctx-size", "2048", "--parallel", str(width),
         "--threads-http", str(HTTP_THREADS), *engine_args],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    made = keys.new_key()
    (work / "setup.json").write_text(json.dumps({
        "model": {"name": "tiny", "aliases": [], "source": gguf.as_uri(), "sha256": "",
                  "profiles": []},
        "replica": {"id": "r1", "model": "tiny", "node": "bench", "profile": "cpu",
                    "state": "ready", "endpoint": f"http://127.0.0.1:{engine_port}",
                    "api_key": key},
        "key": {"id": made.id, "name": "bench-limited", "prefix": made.prefix,
                "hash": made.hash, "rpm": LIMITED_RPM, "tpm": LIMITED_TPM}}))
    (work / "limited-key").write_text(made.text)
    wait_ok(f"http://127.0.0.1:{engine_port}/health")
    gateway, via = start_gateway(work)
    return ([gateway, engine],
            Side(f"http://127.0.0.1:{engine_port}/v1/chat/completions", key, engine.pid),
            via, request_body("tiny"))


NGINX_CONF = """\
# Written by bench/gateway_overhead.py: nginx as a plain reverse proxy, one process.
daemon off;
master_process off;
worker_processes 1;
pid {work}/nginx.pid;
error_log {work}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {work}/nginx-body;
    proxy_temp_path {work}/nginx-proxy;
    fastcgi_temp_path {work}/nginx-fastcgi;
    uwsgi_temp_path {work}/nginx-uwsgi;
    scgi_temp_path {work}/nginx-scgi;
    upstream engine {{
        server {engine};
        keepalive 16;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Authorization "Bearer {key}";
            proxy_buffering off;
        }}
    }}
}}
"""


def start_nginx(work: Path, direct: Side) -> tuple[subprocess.Popen[bytes], Side]:
    """nginx in front of direct's engine, as this bench's child on a free loopback port."""
    binary = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(binary).exists():
        sys.exit("no nginx for the third side: apt-get install -y nginx, or run with "
                 "--no-nginx")
    base, path = direct.url.split("/v1/", 1)
    port, conf = free_port(), work / "nginx.conf"
    conf.write_text(NGINX_CONF.format(work=work, engine=base.removeprefix("http://"),
                                      port=port, key=direct.key))
    proc = subprocess.Popen([binary, "-p", str(work), "-c", str(conf), "-e",
                             str(work / "nginx-error.log")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while listener_pid(port) == 0:
        if proc.poll() is not None or time.monotonic() > deadline:
            log = (work / "nginx-error.log")
            sys.exit(f"nginx did not listen on 127.0.0.1:{port}: "
                     f"{log.read_text() if log.exists() else 'no error log'}")
        time.sleep(0.1)
    return proc, Side(f"http://127.0.0.1:{port}/v1/{path}", "", proc.pid)


LITELLM_VENV = Path.home() / ".cache" / "llmgw-bench" / "litellm-venv"
LITELLM_KEY = "sk-llmgw-bench-master"
LITELLM_CONF = """\
# Written by bench/gateway_overhead.py: LiteLLM's proxy in front of the bench's engine.
model_list:
  - model_name: {model}
    litellm_params:
      model: openai/{model}
      api_base: {base}/v1
      api_key: {key}
litellm_settings:
  telemetry: false
general_settings:
  master_key: {master}
"""


def litellm_binary() -> str:
    """$LLMGW_BENCH_LITELLM, else LITELLM_VENV's, made here the first time (never the
    project's venv: LiteLLM is no dependency of llmgw)."""
    given = os.environ.get("LLMGW_BENCH_LITELLM")
    if given:
        print(f"LiteLLM: {given} ($LLMGW_BENCH_LITELLM)")
        return given
    binary = LITELLM_VENV / "bin" / "litellm"
    if not binary.exists():
        print(f"LiteLLM: installing litellm[proxy] into {LITELLM_VENV} (once)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(LITELLM_VENV)], check=True)
        subprocess.run([str(LITELLM_VENV / "bin" / "pip"), "install", "-q", "litellm[proxy]"],
                       check=True)
    version = subprocess.run(
        [str(LITELLM_VENV / "bin" / "python"), "-c",
         "import importlib.metadata as m; print(m.version('litellm'))"],
        capture_output=True, text=True).stdout.strip()
    print(f"LiteLLM {version}: {binary}")
    return str(binary)


def start_litellm(work: Path, direct: Side, model: str) -> tuple[subprocess.Popen[bytes], Side]:
    """LiteLLM's proxy in front of direct's engine: one worker, a master key."""
    binary = litellm_binary()
    base = direct.url.split("/v1/", 1)[0]
    port, conf = free_port(), work / "litellm.yaml"
    conf.write_text(LITELLM_CONF.format(model=model, base=base, key=direct.key,
                                        master=LITELLM_KEY))
    log = work / "litellm.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([binary, "--config", str(conf), "--host", "127.0.0.1",
                                 "--port", str(port), "--num_workers", "1"], cwd=work,
                                env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
                                stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health/liveliness", timeout=2
                         ).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            sys.exit(f"LiteLLM did not answer on 127.0.0.1:{port} within 120 s; its log, "
                     f"{log}:\n{log.read_text()[-2000:]}")
        time.sleep(0.5)
    # The process that serves (the CLI may run uvicorn in a child).
    pid = listener_pid(port) or proc.pid
    return proc, Side(f"http://127.0.0.1:{port}/v1/chat/completions", LITELLM_KEY, pid)


def on_host(layout: Layout, model: str) -> tuple[Side, Side, str]:
    """A provisioned host's gateway, and the engine of one of its ready replicas."""
    config = load_server(layout.server_yaml)
    db = Path(config.state_dir) / "control.db"
    if not db.exists():
        sys.exit(f"no control plane database at {db}: is this host provisioned "
                 "(pytest provision/ with the same --state-dir or --mode)?")
    query = "SELECT id, model, endpoint, api_key FROM replicas WHERE state = 'ready'"
    try:
        # Read-only: the database belongs to the control plane (in system mode, its user).
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
            ready = conn.execute(query).fetchall()
    except sqlite3.Error as e:
        sys.exit(f"cannot read {db}: {e}; run as the user who provisioned the host, or root")
    ready = [r for r in ready if r[2] and (not model or r[1] == model)]
    if not ready:
        sys.exit(f"no ready replica{f' of {model}' if model else ''} in {db}: `llmgw "
                 "status` shows what runs; wait for one or name another with --model")
    rid, name, endpoint, api_key = ready[0]
    port = int(endpoint.rsplit(":", 1)[1])
    gateway = connect_host(config.gateway_listen)
    gw_port = int(gateway.rsplit(":", 1)[1])
    print(f"host {layout.etc}: replica {rid} of {name} at {endpoint}, gateway {gateway}")
    return (Side(f"{endpoint}/v1/chat/completions", api_key, listener_pid(port)),
            Side(f"http://{gateway}/v1/chat/completions", _host_key(layout, config.tokens),
                 listener_pid(gw_port)),
            request_body(name))


def _host_key(layout: Layout, tokens: list[str]) -> str:
    """The owner's gateway key provisioning made, else server.yaml's first token."""
    try:
        return layout.gateway_key.read_text().strip()
    except OSError:
        return tokens[0] if tokens else ""


def main() -> None:
    if sys.argv[1:2] == ["--serve-gateway"]:
        serve_gateway(Path(sys.argv[2]), int(sys.argv[3]))
        return
    if sys.argv[1:2] == ["--generate"]:
        url, key, body, width, seconds = sys.argv[2:7]
        print(json.dumps(asyncio.run(_generate(url, key, body, int(width),
                                               float(seconds))).__dict__))
        return
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0, help="per measurement")
    parser.add_argument("--pairs", type=int, default=15,
                        help="direct/gateway pairs per width: on 2 shared cores, 5 pairs' "
                             "medians swung by ±0.05 from run to run")
    parser.add_argument("--gateway-nice", type=int, default=0,
                        help="run the bench's gateway at this nice value (negative: ahead of "
                             "the engine's threads when both want the CPU)")
    parser.add_argument("--engine-args", default="",
                        help="more flags for the bench's llama-server, as one string: "
                             "'--threads 1' leaves the gateway and the load generator a core "
                             "of 2; '--poll 0' stops its threads spinning while they wait")
    parser.add_argument("--old-src", default="",
                        help="another checkout's src folder: its gateway is measured too, "
                             "in the same rounds (gateway/old: this code over that)")
    parser.add_argument("--no-nginx", action="store_true",
                        help="leave out the third side, nginx in front of the engine")
    parser.add_argument("--no-litellm", action="store_true",
                        help="leave out the fourth side, LiteLLM's proxy in front of the engine")
    parser.add_argument("--no-limited", action="store_true",
                        help="leave out the side that sends the gateway a key with limits")
    parser.add_argument("--host", action="store_true",
                        help="measure this provisioned host's gateway and engine instead")
    parser.add_argument("--mode", default="auto", help="with --host: as pytest's --mode")
    parser.add_argument("--state-dir", default=None,
                        help="with --host: as pytest's --state-dir (local mode)")
    parser.add_argument("--model", default="",
                        help="with --host: the model whose replica to use (default: the "
                             "first ready one)")
    args = parser.parse_args()
    load = hey if shutil.which("hey") else python_load
    print(f"load generator: {'hey' if load is hey else 'Python, in its own process'}; "
          f"{args.pairs} pairs of {args.seconds:.0f} s per width, medians of the pairs")
    procs: list[subprocess.Popen[bytes]] = []
    work = Path(tempfile.mkdtemp(prefix="llmgw-bench-"))
    if args.host:
        direct, via, body = on_host(Layout.for_mode(args.mode, args.state_dir), args.model)
    else:
        procs, direct, via, body = start_own(work, max(WIDTHS), shlex.split(args.engine_args))
        if args.gateway_nice:
            os.setpriority(os.PRIO_PROCESS, via.pid, args.gateway_nice)
    sides = [("direct", direct), ("gateway", via)]
    if not args.host and not args.no_limited:
        sides.append(("limited", Side(via.url, (work / "limited-key").read_text(), via.pid)))
    if not args.no_nginx:
        nginx, proxy = start_nginx(work, direct)
        procs.append(nginx)
        sides.append(("nginx", proxy))
    if not args.no_litellm:
        litellm, proxied = start_litellm(work, direct, json.loads(body)["model"])
        procs.append(litellm)
        sides.append(("LiteLLM", proxied))
    if args.old_src and not args.host:
        if not (Path(args.old_src) / "llmgw").is_dir():
            sys.exit(f"--old-src {args.old_src} holds no llmgw package: name a checkout's "
                     "src folder")
        old, before = start_gateway(work, args.old_src)
        procs.append(old)
        sides.append(("old", before))
        if not args.no_limited:
            sides.append(("old-limited", Side(before.url, (work / "limited-key").read_text(),
                                              before.pid)))
    results: dict[tuple[str, int], list[Run]] = {}
    pids = {"engine": direct.pid, **{name: side.pid for name, side in sides[1:]}}
    try:
        for name, side in sides:  # warm each: its first answer first (LiteLLM's is slow)
            first_answer(name, side, body)
            load(side, body, 4, 1.0)
        for width in WIDTHS:
            for i in range(args.pairs):
                # Each side goes first in turn, so a load that rises or falls through the
                # run favours none.
                for name, side in sides[i % len(sides):] + sides[:i % len(sides)]:
                    results.setdefault((name, width), []).append(
                        measured(load, side, body, width, args.seconds, pids))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
    report(results)


def finite_median(values: Iterable[float]) -> float:
    """The median of the rounds that had a p50 (a round with no answer has none)."""
    finite = [v for v in values if math.isfinite(v)]
    return statistics.median(finite) if finite else math.nan


def report(results: dict[tuple[str, int], list[Run]]) -> None:
    print(f"{'':<10}{'width':>6}{'req/s':>10}{'p50 ms':>10}{'non-200':>9}   each pair (req/s)")
    for (side, width), runs in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"{side:<10}{width:>6}{statistics.median(r.rps for r in runs):>10.1f}"
              f"{finite_median(r.p50_ms for r in runs):>10.2f}"
              f"{sum(r.non_200 for r in runs):>9}   {', '.join(f'{r.rps:.0f}' for r in runs)}")

    def ratio(width: int, over: str = "direct", side: str = "gateway") -> float:
        pairs = zip(results[(side, width)], results[(over, width)], strict=True)
        return statistics.median(g.rps / d.rps for g, d in pairs)

    def cpu(side: str, width: int, process: str) -> float:
        return statistics.median((r.cpu_ms or {}).get(process, math.nan)
                                 for r in results[(side, width)])

    for width in WIDTHS:
        print(f"CPU ms per request at {width}: engine {cpu('direct', width, 'engine'):.2f} "
              f"direct, {cpu('gateway', width, 'engine'):.2f} through the gateway; the "
              f"gateway's own {cpu('gateway', width, 'gateway'):.2f}; the load generator "
              f"{cpu('direct', width, 'load'):.2f} direct, {cpu('gateway', width, 'load'):.2f}")
    # At 16 in flight a small engine keeps every core busy: each side's throughput is then
    # the CPUs over what a request costs them all, and the gateway's share sets the ratio.
    direct16 = cpu("direct", 16, "engine") + cpu("direct", 16, "load")
    via16 = sum(cpu("gateway", 16, p) for p in ("engine", "gateway", "load"))
    if math.isfinite(direct16 + via16):
        print(f"at 16, were the CPUs all that limited both sides: {direct16 / via16:.2f}× "
              f"(the gateway's share of a request's CPU: "
              f"{cpu('gateway', 16, 'gateway') / via16:.0%})")
    pairs = zip(results[("gateway", 1)], results[("direct", 1)], strict=True)
    added = finite_median(g.p50_ms - d.p50_ms for g, d in pairs)
    t16, t1 = ratio(16), ratio(1)
    met = [t16 >= 0.9, t1 >= 0.8, added <= 1.0]
    print(f"goals (>=0.9x at 16, >=0.8x at 1, p50 +<=1 ms): "
          f"{'met' if all(met) else 'NOT met: ' + str(met)}")
    print(f"gateway/direct: throughput {t16:.2f}× at 16, {t1:.2f}× at 1; p50 {added:+.1f} ms "
          "at 1")
    if ("old", 1) in results:
        new_old = (ratio(1, "old"), ratio(16, "old"))
        print(f"gateway/old (this checkout's gateway over --old-src's): throughput "
              f"{new_old[1]:.2f}× at 16, {new_old[0]:.2f}× at 1; own CPU ms per request "
              f"{cpu('gateway', 16, 'gateway'):.3f} vs {cpu('old', 16, 'old'):.3f} at 16, "
              f"{cpu('gateway', 1, 'gateway'):.3f} vs {cpu('old', 1, 'old'):.3f} at 1; goal "
              f"(>=0.97x at both): {'met' if min(new_old) >= 0.97 else 'NOT met'}")
    for side in ("nginx", "LiteLLM"):
        if (side, 1) in results:
            print(f"{side}/direct: throughput {ratio(16, 'direct', side):.2f}× at 16, "
                  f"{ratio(1, 'direct', side):.2f}× at 1")
    if ("old-limited", 1) in results:
        print(f"limited/old-limited (the key with limits, this checkout's gateway over "
              f"--old-src's): throughput {ratio(16, 'old-limited', 'limited'):.2f}× at 16, "
              f"{ratio(1, 'old-limited', 'limited'):.2f}× at 1; own CPU ms per request "
              f"{cpu('limited', 16, 'gateway'):.3f} vs {cpu('old-limited', 16, 'old'):.3f} at "
              f"16, {cpu('limited', 1, 'gateway'):.3f} vs {cpu('old-limited', 1, 'old'):.3f} "
              "at 1")
    if ("limited", 1) in results:
        print(f"limited/gateway (a key with rpm and tpm over none): throughput "
              f"{ratio(16, 'gateway', 'limited'):.2f}× at 16, "
              f"{ratio(1, 'gateway', 'limited'):.2f}× at 1; own CPU ms per request "
              f"{cpu('limited', 16, 'gateway'):.3f} vs {cpu('gateway', 16, 'gateway'):.3f} at "
              f"16, {cpu('limited', 1, 'gateway'):.3f} vs {cpu('gateway', 1, 'gateway'):.3f} "
              "at 1")
    for side in ("gateway", "nginx", "LiteLLM"):
        if (side, 1) in results:
            print(f"{side}'s own CPU ms per request: {cpu(side, 1, side):.3f} at 1, "
                  f"{cpu(side, 16, side):.3f} at 16")
    parts = []
    for side in ("nginx", "LiteLLM"):
        if (side, 1) in results:
            parts.append(f"gateway/{side} {ratio(1, side):.2f}x at 1, {ratio(16, side):.2f}x "
                         "at 16")
    if ("limited", 1) in results and ("nginx", 1) in results:
        parts.append(f"limited/nginx {ratio(1, 'nginx', 'limited'):.2f}x at 1, "
                     f"{ratio(16, 'nginx', 'limited'):.2f}x at 16")
    if ("nginx", 1) in results and ("LiteLLM", 1) in results:
        met = [ratio(1, "nginx") >= 0.9, ratio(16, "nginx") >= 0.9,
               ratio(1, "LiteLLM") >= 5, ratio(16, "LiteLLM") >= 5]
        print("goals (gateway/nginx >= 0.9x at 1 and 16; gateway/LiteLLM >= 5x at both): "
              f"{'met' if all(met) else 'NOT met: ' + str(met)}")
    own = [f"{side} {cpu(side, 16, side):.3f}" for side in ("gateway", "nginx", "LiteLLM")
           if (side, 16) in results]
    if ("limited", 16) in results:
        own.insert(1, f"limited {cpu('limited', 16, 'gateway'):.3f}")
    print("; ".join([*parts, "CPU per request ms: " + ", ".join(own)]))


if __name__ == "__main__":
    main()
