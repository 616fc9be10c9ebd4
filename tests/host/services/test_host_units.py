"""The three units a system-mode host installs pass `systemd-analyze verify`."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from llmgw.host.install import LINK
from llmgw.host.layout import Layout
from llmgw.host.services import ServiceSpec
from llmgw.host.services._systemd import render_unit
from llmgw_harness import control_plane, mirror
from llmgw_harness.node import agent_service
from llmgw_harness.settings import HostSettings

pytestmark = pytest.mark.skipif(not shutil.which("systemd-analyze"),
                                reason="systemd-analyze is not installed here")


def specs() -> list[ServiceSpec]:
    settings = HostSettings(layout=Layout.for_mode("system"), advertise=("llm.example",))
    return [
        control_plane.service_spec(settings.layout),
        mirror.service_spec(settings),
        agent_service(Path("/etc/llmgw/agent.yaml")),
    ]


@pytest.mark.parametrize("spec", specs(), ids=lambda s: s.name)
def test_unit_verifies(spec: ServiceSpec, tmp_path: Path) -> None:
    unit = tmp_path / f"{spec.name}.service"
    # The installed llmgw is not on this machine; verify the unit's directives with a
    # program that is (systemd-analyze checks that ExecStart's program exists).
    unit.write_text(render_unit(spec).replace(str(LINK), "/bin/true"))
    proc = subprocess.run(["systemd-analyze", "verify", str(unit)],
                          capture_output=True, text=True, check=False)
    mine = [line for line in proc.stderr.splitlines() if unit.name in line]
    assert proc.returncode == 0 and not mine, proc.stderr
