"""The join line and token lifetimes, from the control plane's files."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.cli.fleet import advertised_host, agent_url, join_line, parse_ttl
from llmgw.config import ConfigError, ServerConfig, TLSFiles
from llmgw.host import pki


@pytest.mark.parametrize(("text", "seconds"), [("90s", 90), ("15m", 900), ("1h", 3600),
                                               ("2d", 172800), ("30", 30), ("1.5h", 5400)])
def test_ttl(text: str, seconds: float) -> None:
    assert parse_ttl(text) == seconds


@pytest.mark.parametrize("text", ["", "0h", "soon", "1w", "-5m"])
def test_a_ttl_that_is_no_duration_says_how_to_write_one(text: str) -> None:
    with pytest.raises(ConfigError, match="write 90s, 15m, 1h or 2d"):
        parse_ttl(text)


def _config(tmp_path: Path, names: list[str], advertise: str = "") -> ServerConfig:
    ca = pki.create_ca()
    ca.write(tmp_path, "ca")
    pki.issue_server(ca, names).write(tmp_path, "server")
    return ServerConfig(agent_listen=":7443", advertise=advertise,
                        tls=TLSFiles(ca=str(tmp_path / "ca.pem"),
                                     cert=str(tmp_path / "server.pem"), key=""))


def test_the_join_line_is_exactly_what_the_new_machine_runs(tmp_path: Path) -> None:
    config = _config(tmp_path, ["cp.example", "10.0.0.5"], advertise="cp.example")
    ca_hash = pki.ca_hash(pki.load_cert(tmp_path / "ca.pem"))
    assert join_line(config, "abc.def") == (
        f"pytest provision/ --join https://cp.example:7443 --token abc.def --ca-hash {ca_hash}")


def test_without_advertise_the_certificate_names_a_reachable_address(tmp_path: Path) -> None:
    config = _config(tmp_path, ["localhost", "127.0.0.1", "10.0.0.5"])
    assert advertised_host(config) == "10.0.0.5"


def test_an_ipv6_host_is_bracketed(tmp_path: Path) -> None:
    config = _config(tmp_path, ["fd00::2"], advertise="fd00::2")
    assert "--join https://[fd00::2]:7443 " in join_line(config, "t")


def test_the_agent_url_is_the_advertised_host_and_the_agent_port(tmp_path: Path) -> None:
    """What the join line names, and what a heartbeat answer names this control plane by."""
    config = _config(tmp_path, ["cp.example"], advertise="cp.example")
    assert agent_url(config) == "https://cp.example:7443"
    config = config.model_copy(update={"agent_listen": "0.0.0.0:9443"})
    assert agent_url(config) == "https://cp.example:9443"
    assert agent_url(_config(tmp_path, ["fd00::2"], advertise="fd00::2")) == (
        "https://[fd00::2]:7443")
