"""`llmgw down`: stop everything a host runs (its config, certificates and models stay)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

from llmgw.agent.replicas.process import stop_engines
from llmgw.host.layout import Layout
from llmgw.host.services import ServiceError
from llmgw.host.services._supervisor import Supervisor

# The checks go first, so that no round reports the others stopping as drift. The agent
# next, so that it cannot start an engine again; engines outlive their agent by design, so
# they are stopped on their own afterwards. The gateway's socket unit goes before its
# service: it would start the service again on the next connection.
UNITS = ("llmgw-check", "llmgw-agent", "llmgw-gateway.socket", "llmgw-gateway", "llmgw-mirror",
         "llmgw-server")


def down(state_dir: str | os.PathLike[str] | None, mode: str = "local") -> Iterator[str]:
    """Stop the host's services, then the engines the agent left running.

    Yields one line per thing stopped or found stopped. Local mode stops supervisord and
    its programs; system mode stops and disables the units, so a reboot does not bring
    them back (`pytest provision/` enables them again).
    """
    layout = Layout.for_mode(mode, state_dir)
    yield from _down_system() if layout.mode == "system" else _down_local(layout)
    engines = stop_engines(layout.agent_state)
    if engines:
        yield f"stopped engines {', '.join(engines)}"


def _down_local(layout: Layout) -> Iterator[str]:
    assert layout.root is not None
    if Supervisor(layout.root).stop_daemon():
        yield f"stopped supervisord and its programs in {layout.root}"
    else:
        yield f"supervisord was not running in {layout.root}"


def _down_system() -> Iterator[str]:
    active = [u for u in UNITS if _systemctl("is-active", "--quiet", u).returncode == 0]
    for unit in UNITS:
        if _systemctl("cat", unit).returncode != 0:
            continue  # never installed here (--no-mirror, --no-node)
        proc = _systemctl("disable", "--now", unit)
        if proc.returncode != 0:
            raise ServiceError(f"systemctl disable --now {unit} failed ({proc.returncode}): "
                               f"{proc.stderr.strip()}; see `journalctl -u {unit}`")
        yield (f"stopped and disabled {unit}" if unit in active
               else f"{unit} was not running; disabled it")


def _systemctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["systemctl", *args], capture_output=True, text=True, check=False)
