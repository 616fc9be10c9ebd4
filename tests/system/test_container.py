"""The container harness's own preconditions, without booting anything."""

from __future__ import annotations

import os
import socket

from tests.system.container import on_root_filesystem, taken_ports


def test_a_port_something_listens_on_is_taken() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert taken_ports([port]) == [port]
    assert taken_ports([port]) == []


def test_the_overlay_dirs_sit_on_the_root_filesystem() -> None:
    assert os.stat(on_root_filesystem()).st_dev == os.stat("/").st_dev
