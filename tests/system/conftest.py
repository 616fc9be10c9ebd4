"""A booted systemd container for the system-mode tests (see container.py)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw.agent.engines import cache
from tests.system.container import (
    DEFAULT_PORTS,
    SYSTEM_PATHS,
    CannotBoot,
    SystemdContainer,
    install_nspawn,
    on_root_filesystem,
    taken_ports,
    why_cannot_boot,
)

ROOT = Path(__file__).resolve().parents[2]
# System mode's engine cache, and this machine's: the build is copied in, never redone.
SYSTEM_ENGINES = str(cache.engines(cache.SYSTEM_ROOT))


def _seed_engine_cache(c: SystemdContainer) -> None:
    """Copy this machine's built engines into the container's upper dir (a few MB: the
    build is one static file), so its agent finds them in its cache."""
    host = cache.engines(cache.user_root())
    for binary in host.glob("*/*/llama-server"):
        shutil.copytree(binary.parent, c.upper / SYSTEM_ENGINES.lstrip("/")
                        / binary.parent.relative_to(host))


def _clone_checkout(c: SystemdContainer) -> None:
    """This checkout's committed HEAD, cloned to /root/llmgw inside (as a user would)."""
    subprocess.run(["git", "clone", "-q", str(ROOT), str(c.path("/root/llmgw"))],
                   check=True, capture_output=True)


def _fresh_host_problem() -> str:
    there = [p for p in SYSTEM_PATHS if Path(p).exists()]
    return (f"this machine's root already has {', '.join(there)}, so the container would "
            "not start as a fresh host; the system test needs a machine without a "
            "system-mode llmgw") if there else ""


@pytest.fixture(scope="module")
def systemd_container() -> Iterator[SystemdContainer]:
    """Module: a booted systemd container over a throwaway overlay of this machine's /,
    sharing its network, with this checkout cloned to /root/llmgw and the engine cache
    seeded. Changes nothing on this machine beyond the overlay's dirs (removed after).
    One per module, so each module starts from a fresh host (a boot takes seconds); two
    never run at once, since they would share the ports.

    Skipped, saying why, where it cannot run: not root, no overlayfs, nspawn cannot boot.
    Fails when one of the default ports is taken here (the container would fight for it).
    """
    install_nspawn()
    why = why_cannot_boot()
    if why:
        pytest.skip(why)
    taken = taken_ports()
    assert not taken, (
        f"port(s) {', '.join(map(str, taken))} of {DEFAULT_PORTS} are taken on this machine; "
        "the container shares its network and provisions on the default ports. Stop what "
        "listens there (`ss -ltnp`) and run again"
    )
    assert not _fresh_host_problem(), _fresh_host_problem()
    try:
        base = Path(tempfile.mkdtemp(prefix="llmgw-system-", dir=on_root_filesystem()))
        base.rmdir()
        c = SystemdContainer.prepare(base)
    except CannotBoot as e:
        pytest.skip(str(e))
    try:
        _seed_engine_cache(c)
        _clone_checkout(c)
        c.start()
    except BaseException:
        left = c.stop()
        if left:
            print(left)
        raise
    yield c
    left = c.stop()
    assert not left, left
