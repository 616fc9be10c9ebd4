"""A real PostgreSQL server for the tests, on loopback, made and removed by the test session.

Debian's `postgresql` package gives the binaries (`pg_config --bindir`); PostgreSQL refuses
to run as root, so as root the cluster belongs to the `postgres` user (`runuser`), in a
folder of its own under /tmp: pytest's temporary folders are 0700 root's, which that user
cannot enter. pytest-postgresql's process fixture would run pg_ctl as root; its no-process
fixture wants a server already there; this module is that server, in 80 lines.
"""

from __future__ import annotations

import itertools
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import psycopg

_OWNER = "postgres"
# The one user of the test server that must give a password (create_database_with_password).
PASSWORD_USER, PASSWORD = "llmgw_pw", "right-password"


def bindir() -> Path | None:
    """Where PostgreSQL's server binaries are, or None when it is not installed."""
    pg_config = shutil.which("pg_config")
    if pg_config:
        found = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True)
        path = Path(found.stdout.strip())
        if found.returncode == 0 and (path / "initdb").exists():
            return path
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    return versions[-1].parent if versions else None


class PostgresServer:
    """One cluster: initdb'd on first start, its databases made one per test."""

    def __init__(self, binaries: Path) -> None:
        self.bin = binaries
        self.root = Path(tempfile.mkdtemp(prefix="llmgw-pg-"))
        self.data = self.root / "data"
        self.port = _free_port()
        self._names = itertools.count(1)
        self._as_owner = os.geteuid() == 0
        if self._as_owner:
            entry = pwd.getpwnam(_OWNER)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust",
                  "--no-sync", "-E", "UTF8")
        # Every user is trusted but one, which must give its password: a wrong one is
        # refused as a real server refuses it (the first matching line wins).
        hba = self.data / "pg_hba.conf"
        hba.write_text(f"host all {PASSWORD_USER} 127.0.0.1/32 scram-sha-256\n"
                       + hba.read_text())
        self._password_role = False

    def _run(self, tool: str, *args: str) -> None:
        argv = [str(self.bin / tool), *args]
        if self._as_owner:
            argv = ["runuser", "-u", _OWNER, "--", *argv]
        done = subprocess.run(argv, capture_output=True, text=True, cwd=self.root)
        if done.returncode != 0:
            log = self.root / "log"
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise RuntimeError(f"{tool} {' '.join(args)} failed ({done.returncode}): "
                               f"{done.stderr.strip() or done.stdout.strip()}\n{tail}")

    def start(self) -> None:
        # Durability off: a test's database is thrown away, and fsyncs on shared disks cost
        # seconds a test.
        options = (f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} "
                   "-c fsync=off -c synchronous_commit=off -c full_page_writes=off "
                   "-c max_connections=200")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "log"), "-o", options,
                  "-w", "-t", "60", "start")

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        """A new empty database; its URL."""
        name = f"t{os.getpid()}_{next(self._names)}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def create_database_with_password(self) -> str:
        """A new empty database owned by a user that must give its password; its URL,
        password in it (PASSWORD)."""
        name = f"p{os.getpid()}_{next(self._names)}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            if not self._password_role:
                conn.execute(f"CREATE ROLE {PASSWORD_USER} LOGIN PASSWORD '{PASSWORD}'")
                self._password_role = True
            conn.execute(f'CREATE DATABASE "{name}" OWNER {PASSWORD_USER}')
        return f"postgresql://{PASSWORD_USER}:{PASSWORD}@127.0.0.1:{self.port}/{name}"

    def remove(self) -> None:
        try:
            self.stop("immediate")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
