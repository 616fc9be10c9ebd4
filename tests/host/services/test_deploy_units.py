"""The units shipped in deploy/systemd are the ones provisioning writes on a system-mode host.

Host-specific values show as placeholders: the address nodes reach this machine at is
ADVERTISED_ADDRESS (provisioning puts the first --advertise name there). After a change to
a unit, regenerate them: `.venv/bin/python -m tests.host.services.test_deploy_units`.
"""

from __future__ import annotations

import difflib
from pathlib import Path

import pytest

from llmgw.host.layout import Layout
from llmgw.host.services import ServiceSpec
from llmgw.host.services._systemd import render_socket, render_unit
from llmgw_harness import control_plane, gateway, mirror, watch
from llmgw_harness.node import agent_service
from llmgw_harness.settings import HostSettings

DEPLOY = Path(__file__).resolve().parents[3] / "deploy" / "systemd"
PLACEHOLDER = "ADVERTISED_ADDRESS"


def rendered() -> dict[str, str]:
    """unit file name → the text provisioning writes, with placeholders for this host."""
    layout = Layout.for_mode("system")
    settings = HostSettings(layout=layout, advertise=(PLACEHOLDER,))
    specs: list[ServiceSpec] = [
        control_plane.service_spec(layout),
        gateway.service_spec(layout),
        mirror.service_spec(settings),
        agent_service(layout.agent_yaml, "system"),
        watch.service_spec(layout),
    ]
    units = {f"{s.name}.service": render_unit(s) for s in specs}
    units |= {f"{s.name}.socket": render_socket(s) for s in specs if s.socket}
    return units


@pytest.mark.parametrize("name", sorted(rendered()))
def test_the_shipped_unit_is_what_provisioning_writes(name: str) -> None:
    shipped = (DEPLOY / name).read_text() if (DEPLOY / name).exists() else ""
    want = rendered()[name]
    diff = "".join(difflib.unified_diff(shipped.splitlines(True), want.splitlines(True),
                                        f"deploy/systemd/{name}", "rendered"))
    assert shipped == want, (
        f"deploy/systemd/{name} differs from what provisioning writes:\n{diff}\n"
        "regenerate it: .venv/bin/python -m tests.host.services.test_deploy_units"
    )


def test_the_gateway_takes_its_socket_from_systemd_and_may_drain_before_a_kill() -> None:
    """Connections wait in llmgw-gateway.socket's backlog while the service restarts; the
    stop lets the drain (gateway_drain_s, 30 s by default) finish first."""
    socket_unit = (DEPLOY / "llmgw-gateway.socket").read_text()
    service_unit = (DEPLOY / "llmgw-gateway.service").read_text()
    assert "ListenStream=0.0.0.0:8080\n" in socket_unit
    assert "Requires=llmgw-gateway.socket\n" in service_unit
    assert "TimeoutStopSec=45s\n" in service_unit and "KillMode=mixed\n" in service_unit
    assert "User=llmgw\n" in service_unit and "ProtectSystem=strict\n" in service_unit


def test_the_mirror_unit_shows_the_address_as_a_placeholder() -> None:
    text = (DEPLOY / "llmgw-mirror.service").read_text()
    assert f"--base http://{PLACEHOLDER}:8081" in text, text


if __name__ == "__main__":
    DEPLOY.mkdir(parents=True, exist_ok=True)
    for name, text in rendered().items():
        (DEPLOY / name).write_text(text)
        print(f"wrote deploy/systemd/{name}")
