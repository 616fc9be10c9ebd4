"""The watch step decides where and how often llmgw-check runs: on by default when
provisioning, on loopback; what a host recorded wins over the default; --no-check-serve
leaves it out; a read-only run on a host never told to check starts nothing."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from llmgw.config import CHECK_INTERVAL_S, CHECK_LISTEN, parse_listen
from llmgw.host.layout import Layout
from llmgw_harness import watch
from llmgw_harness._host import Host
from llmgw_harness.settings import HostSettings, Listen


def host(tmp_path: Path, *, apply: bool = True, **settings: object) -> Host:
    layout = Layout.for_mode("local", tmp_path / "state")
    return Host(HostSettings(layout=layout, **settings), apply=apply)  # type: ignore[arg-type]


def test_provision_runs_the_checks_by_default_on_loopback(tmp_path: Path) -> None:
    h = host(tmp_path)
    assert watch.recorded(h) == (CHECK_LISTEN, CHECK_INTERVAL_S)
    assert parse_listen(CHECK_LISTEN)[0] == "127.0.0.1"
    assert watch._skip(h) is None
    spec = watch.service_spec(h.layout, *watch.recorded(h))  # type: ignore[misc]
    assert spec.name == "llmgw-check"
    assert spec.command[1:4] == ["check", "--serve", CHECK_LISTEN]


def test_no_check_serve_leaves_the_step_out_saying_so(tmp_path: Path) -> None:
    """The negative control: with --no-check-serve nothing runs, and the skip says why."""
    h = host(tmp_path, no_check_serve=True)
    assert watch.recorded(h) is None
    why = watch._skip(h)
    assert why is not None and why.startswith("--no-check-serve: nothing keeps checking")


def test_the_default_address_is_a_listen_default_the_fixtures_replace(tmp_path: Path) -> None:
    """Like the other listeners' defaults it is spelled once (Listen), so a host on free
    ports (the fixtures, llmgw_host) gets one for its checks as well."""
    assert Listen().check == CHECK_LISTEN
    h = host(tmp_path, listen=replace(Listen(), check="127.0.0.1:4321"))
    assert watch.recorded(h) == ("127.0.0.1:4321", CHECK_INTERVAL_S)


def test_what_a_host_recorded_is_kept_unless_this_run_says_otherwise(tmp_path: Path) -> None:
    h = host(tmp_path)
    h.layout.check_serve.parent.mkdir(parents=True)
    h.layout.check_serve.write_text("127.0.0.1:5555 7\n")
    assert watch.recorded(h) == ("127.0.0.1:5555", 7.0)
    assert watch.recorded(host(tmp_path, apply=False)) == ("127.0.0.1:5555", 7.0)
    assert watch.recorded(host(tmp_path, check_serve="127.0.0.1:6666")) == ("127.0.0.1:6666", 7.0)
    assert watch.recorded(host(tmp_path, check_interval=30.0)) == ("127.0.0.1:5555", 30.0)


def test_checks_on_a_host_never_told_to_check_skip_the_step(tmp_path: Path) -> None:
    """`pytest checks/` on a host provisioned before the checks were on by default (no
    etc/check-serve) starts nothing and fails nothing: the step is skipped, saying how
    provision would turn the checks on."""
    h = host(tmp_path, apply=False)
    assert watch.recorded(h) is None
    why = watch._skip(h)
    assert why is not None and "`pytest provision/` starts llmgw-check" in why


def test_an_address_another_process_holds_fails_at_once_naming_it(tmp_path: Path) -> None:
    """Provision cannot fix a port someone else listens on: the probe says so, with what
    to do, instead of starting llmgw-check to wait for an answer that never comes. The
    control: with the socket closed, the problem is only that nothing runs there yet."""
    import socket

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    addr = f"127.0.0.1:{busy.getsockname()[1]}"
    h = host(tmp_path, check_serve=addr)
    try:
        problem = watch.service(h)
    finally:
        busy.close()
    assert problem is not None and not problem.fixable
    assert problem.found == f"{addr} cannot be listened on (Address already in use)"
    assert "--check-serve HOST:PORT" in problem.message()
    freed = watch.service(h)
    assert freed is not None and freed.fixable and freed.found.startswith("there is no ")
