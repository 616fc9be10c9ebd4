"""The service manager a layout's services run under: systemd in system mode, else this
layout's own supervisord. Beside the package's __init__, not in it: the managers import the
package's names, and the package does not import them (no import cycle)."""

from __future__ import annotations

from llmgw.host.layout import Layout
from llmgw.host.services import ServiceManager


def manager_for(layout: Layout) -> ServiceManager:
    if layout.mode == "system":
        from llmgw.host.services._systemd import Systemd

        return Systemd()
    from llmgw.host.services._supervisor import Supervisor

    assert layout.root is not None
    return Supervisor(layout.root)
