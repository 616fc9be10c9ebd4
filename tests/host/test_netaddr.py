"""free_port: a port a listener can bind later, outside the kernel's ephemeral range."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from llmgw.host import netaddr
from llmgw.host.netaddr import ephemeral_ports, free_port


def test_a_free_port_lies_outside_the_ephemeral_range_and_binds() -> None:
    """Outgoing connections take source ports from the ephemeral range, so a port picked
    there can be gone by the time a service binds it (CI met it: the mirror's bind)."""
    ephemeral = ephemeral_ports()
    ports = [free_port() for _ in range(20)]
    assert not [p for p in ports if p in ephemeral], (ports, ephemeral)
    assert len(set(ports)) == len(ports), "a port was handed out twice"
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))


def test_a_port_already_bound_is_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: with the whole outside range bound but one port, that one comes."""
    with socket.socket() as held, socket.socket() as other:
        held.bind(("127.0.0.1", 0))
        other.bind(("127.0.0.1", 0))
        taken, left = held.getsockname()[1], other.getsockname()[1]
        other.close()
        choices = iter([taken] * 5 + [left])
        monkeypatch.setattr(netaddr.random, "choice", lambda _: next(choices))
        monkeypatch.setattr(netaddr, "_handed_out", set())
        assert free_port() == left


def test_the_range_is_read_from_the_kernel(tmp_path: Path) -> None:
    source = tmp_path / "range"
    source.write_text("40000\t50000\n")
    assert ephemeral_ports(source) == range(40000, 50001)
    assert ephemeral_ports(tmp_path / "absent") == range(32768, 61000)


@pytest.mark.parametrize(("host", "port", "joined"), [
    ("127.0.0.1", 8080, "127.0.0.1:8080"), ("gpu-1.example", 443, "gpu-1.example:443"),
    ("::1", 9000, "[::1]:9000"), ("fd00::5", "8443", "[fd00::5]:8443"), ("", 80, ":80"),
])
def test_host_and_port_join_with_an_ipv6_address_in_brackets(host: str, port: int | str,
                                                             joined: str) -> None:
    assert netaddr.join_host_port(host, port) == joined
