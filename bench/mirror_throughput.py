"""Bytes-server throughput for a 1 GiB file on loopback, against other servers; sha256 cost.

Run on demand, not in the suite:  python bench/mirror_throughput.py [--size-mib 1024]

Serves the same file from the mirror's bytes server (`llmgw mirror serve`), from
`python -m http.server`, from Starlette's FileResponse on uvicorn (the choice the mirror did
not make) and from nginx (installed from Debian when missing), downloads it with curl a few
times each, and prints the median throughput and each one's ratio to the mirror.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from llmgw.host import admin_token
from llmgw.host.netaddr import free_port
from llmgw.mirror import MirrorClient

MIB = 1024 * 1024
STARLETTE_APP = """
import sys
from starlette.applications import Starlette
from starlette.responses import FileResponse
from starlette.routing import Route
path = sys.argv[1]
async def one(request):
    return FileResponse(path)
app = Starlette(routes=[Route("/{name:path}", one)])
"""


def wait_port(port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise SystemExit(f"nothing listened on 127.0.0.1:{port} within {timeout_s:.0f}s")


@contextmanager
def running(argv: list[str], port: int, log: Path) -> Iterator[subprocess.Popen]:
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_port(port)
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()


def curl_mb_s(url: str) -> float:
    out = subprocess.run(
        ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code} %{speed_download} %{size_download}",
         url],
        check=True, capture_output=True, text=True,
    ).stdout.split()
    if out[0] != "200":
        raise SystemExit(f"{url} answered {out[0]} ({out[2]} bytes); see the server's log")
    return float(out[1]) / MIB


def measure(url: str, runs: int) -> float:
    curl_mb_s(url)  # warm: the page cache and the server
    return statistics.median(curl_mb_s(url) for _ in range(runs))


def ensure_nginx() -> str | None:
    sbin = Path("/usr/sbin/nginx")
    found = shutil.which("nginx") or (str(sbin) if sbin.exists() else None)
    if found:
        return found
    if os.geteuid() != 0:
        print("nginx is missing and this is not root: skipping nginx", file=sys.stderr)
        return None
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update"], check=True, env=env, capture_output=True)
    subprocess.run(["apt-get", "install", "-y", "nginx"], check=True, env=env, capture_output=True)
    return shutil.which("nginx") or "/usr/sbin/nginx"


def nginx_conf(work: Path, root: Path, port: int) -> Path:
    conf = work / "nginx.conf"
    conf.write_text(f"""daemon off;
worker_processes 1;
pid {work}/nginx.pid;
error_log {work}/nginx-error.log;
events {{ worker_connections 64; }}
http {{
    access_log off;
    sendfile on;
    client_body_temp_path {work}/nginx-body;
    proxy_temp_path {work}/nginx-proxy;
    fastcgi_temp_path {work}/nginx-fastcgi;
    uwsgi_temp_path {work}/nginx-uwsgi;
    scgi_temp_path {work}/nginx-scgi;
    server {{ listen 127.0.0.1:{port}; root {root}; }}
}}
""")
    return conf


def sha256_s_per_gib(path: Path) -> float:
    h = hashlib.sha256()
    start = time.perf_counter()
    with path.open("rb") as f:
        while chunk := f.read(MIB):
            h.update(chunk)
    return (time.perf_counter() - start) * (1024 * MIB) / path.stat().st_size


def write_file(path: Path, size: int) -> None:
    block = os.urandom(MIB)
    with path.open("wb") as f:
        for i in range(size // MIB):
            f.write(block[i % 256:] + block[: i % 256])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="llmgw-bench-"))
    work.chmod(0o755)  # nginx's workers drop root and must read the file
    try:
        run(work, args.size_mib * MIB, args.runs)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(work: Path, size: int, runs: int) -> None:
    files = work / "files"
    files.mkdir()
    src = files / "model.bin"
    write_file(src, size)
    print(f"file: {size / MIB:.0f} MiB; {runs} downloads each with curl, median; "
          f"{os.cpu_count()} CPUs")
    results: dict[str, float] = {}

    port, api = free_port(), free_port()
    token_path = work / admin_token.TOKEN_FILE
    admin_token.ensure(token_path)
    llmgw = [sys.executable, "-m", "llmgw", "mirror", "serve", "--dir", str(work / "models"),
             "--listen", f"127.0.0.1:{port}", "--api-listen", f"127.0.0.1:{api}",
             "--admin-token-hash", str(admin_token.hash_path_for(token_path))]
    with running(llmgw, api, work / "mirror.log"):
        started = time.perf_counter()
        token = admin_token.read_token(token_path)
        with MirrorClient(f"http://127.0.0.1:{api}", token=token, timeout=60.0) as mirror:
            url = mirror.upload(src, model="bench", version="1").url
        print(f"mirror took in the file (upload + sha256 on both sides) in "
              f"{time.perf_counter() - started:.1f}s")
        results["llmgw mirror (asyncio + sendfile)"] = measure(url, runs)

    port = free_port()
    http_server = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                   "--directory", str(files)]
    with running(http_server, port, work / "http.log"):
        results["python -m http.server"] = measure(f"http://127.0.0.1:{port}/model.bin", runs)

    port = free_port()
    (work / "starlette_app.py").write_text(STARLETTE_APP)
    starlette = [sys.executable, "-c",
                 ("import sys, uvicorn; sys.path.insert(0, sys.argv[2]); "
                 "import starlette_app; uvicorn.run(starlette_app.app, host='127.0.0.1', "
                 "port=int(sys.argv[3]), log_level='warning')"),
                 str(src), str(work), str(port)]
    with running(starlette, port, work / "starlette.log"):
        results["starlette FileResponse on uvicorn"] = measure(
            f"http://127.0.0.1:{port}/model.bin", runs)

    nginx = ensure_nginx()
    if nginx:
        port = free_port()
        conf = nginx_conf(work, files, port)
        with running([nginx, "-c", str(conf), "-p", str(work)], port, work / "nginx.log"):
            results["nginx (sendfile on)"] = measure(f"http://127.0.0.1:{port}/model.bin", runs)

    report(results, sha256_s_per_gib(src))


def report(results: dict[str, float], sha_s: float) -> None:
    mirror = next(iter(results.values()))
    print(f"{'server':<36} {'MiB/s':>9} {'mirror / it':>12}")
    for name, mb_s in results.items():
        print(f"{name:<36} {mb_s:>9.0f} {mirror / mb_s:>11.2f}x")
    print(f"sha256 check: {sha_s:.2f} s per GiB ({1024 / sha_s:.0f} MiB/s, one core, "
          "from the page cache)")


if __name__ == "__main__":
    main()
