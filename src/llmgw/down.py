"""`llmgw down`: stop everything a local-mode host runs."""

from __future__ import annotations

import os
from collections.abc import Iterator

from llmgw.agent.replicas import stop_engines
from llmgw.layout import Layout
from llmgw.services._supervisor import Supervisor


def down(state_dir: str | os.PathLike[str]) -> Iterator[str]:
    """Stop supervisord and its programs, then the engines the agent left running.

    Yields one line per thing stopped or found stopped. The agent goes first so that it
    cannot start an engine again; engines outlive their agent by design.
    """
    layout = Layout.for_mode("local", state_dir)
    assert layout.root is not None
    supervisor = Supervisor(layout.root)
    if supervisor.stop_daemon():
        yield f"stopped supervisord and its programs in {layout.root}"
    else:
        yield f"supervisord was not running in {layout.root}"
    engines = stop_engines(layout.agent_state)
    if engines:
        yield f"stopped engines {', '.join(engines)}"
