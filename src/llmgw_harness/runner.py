"""The provisioning runner, a pytest plugin: options, the registry's promises as tests, the
outcome report (the fixtures other projects' tests use are plugin.py's).

Registered once: by the root conftest.py in a checkout (for provision/ and checks/); by
`llmgw check` (`-p llmgw_harness.runner`, the checkout's conftest not read) from an installed
llmgw. There is no pytest11 entry point, so nothing loads it twice.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from llmgw.config import CHECK_INTERVAL_S
from llmgw.contract.records import CheckRecord
from llmgw.host.layout import MODES

from . import _fleet, _terminal
from ._host import Host
from ._promise import Promise
from ._registry import Registry, load
from ._report import Recorder
from ._run import CHANGE, Run
from .settings import HostSettings, Listen

_recorder_key = pytest.StashKey[Recorder]()
_registry_key = pytest.StashKey[Registry]()
_run_key = pytest.StashKey[Run]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("llmgw", "llmgw host provisioning")
    add = group.addoption
    defaults = Listen()
    add("--mode", dest="llmgw_mode", choices=MODES, default="auto",
        help="system (root with systemd), local (supervisord in --state-dir), or auto")
    add("--state-dir", dest="llmgw_state_dir", default=None, metavar="DIR",
        help="local mode: the folder holding the whole host (default ~/.local/state/llmgw)")
    add("--advertise", dest="llmgw_advertise", action="append", default=[], metavar="NAME",
        help="a name other machines use for this one; repeatable, first preferred")
    add("--no-mirror", dest="llmgw_no_mirror", action="store_true",
        help="do not run a model mirror here")
    add("--no-node", dest="llmgw_no_node", action="store_true",
        help="do not make this machine a node")
    add("--no-starter", dest="llmgw_no_starter", action="store_true",
        help="do not fetch and serve the starter model")
    add("--starter-source", dest="llmgw_starter_source", default=None, metavar="SRC",
        help="where the starter model comes from when the hub cannot be reached "
             "(file:///path, https://..., hf:ORG/REPO/FILE)")
    add("--starter-name", dest="llmgw_starter_name", default=None, metavar="NAME",
        help="the starter's catalog name (default: the GGUF's general.name for a file:// "
             "--starter-source, else qwen2.5-0.5b-instruct); its alias stays qwen-0.5b")
    add("--check-serve", dest="llmgw_check_serve", default=None, metavar="HOST:PORT",
        help="where `llmgw check --serve` answers: provision runs it by default, as the "
             f"service llmgw-check under supervisord (local) or systemd (system), on "
             f"{defaults.check} (or where an earlier run recorded it): /healthz, /metrics, "
             "drift on the fleet page and in `llmgw status`")
    add("--no-check-serve", dest="llmgw_no_check_serve", action="store_true",
        help="leave the watch step out: provision does not start llmgw-check (a host that "
             "runs it already keeps it)")
    add("--check-interval", dest="llmgw_check_interval", type=float, default=None,
        metavar="SECONDS", help="seconds between rounds of llmgw-check (default "
        f"{CHECK_INTERVAL_S:g}, or what an earlier run recorded)")
    add("--join", dest="llmgw_join", default=None, metavar="URL",
        help="make this machine a node of the control plane at URL (https://HOST:7443) "
             "only (or, with --control-plane, another control plane of its fleet); with "
             "--token and --ca-hash, as `llmgw token create` prints them")
    add("--token", dest="llmgw_token", default=None, metavar="TOKEN",
        help="the single-use join token (with --join)")
    add("--ca-hash", dest="llmgw_ca_hash", default=None, metavar="sha256:HEX",
        help="the control plane's CA hash the join pins (with --join)")
    add("--control-plane", dest="llmgw_control_plane", action="store_true",
        help="with --join: make this machine another control plane of that fleet (its "
             "CA, admin credential, gateway key and store), not only a node; with "
             "--certificate-key, as `llmgw token create --control-plane` prints them")
    add("--certificate-key", dest="llmgw_certificate_key", default=None, metavar="HEX",
        help="the key that opens the fleet's sealed bundle (with --control-plane)")
    add("--node-name", dest="llmgw_node_name", default=None, metavar="NAME",
        help="this node's id instead of the hostname (two nodes on one machine)")
    add("--gateway-tls", dest="llmgw_gateway_tls", action="store_true",
        help="the gateway serves HTTPS with the server certificate (from the cluster CA); "
             "used when the host is first provisioned (server.yaml is written once)")
    add("--store", dest="llmgw_store", default=None, metavar="URL",
        help="where the control plane keeps the fleet's state when server.yaml is first "
             "written: postgresql://USER@HOST:PORT/DB (an existing, empty database, "
             "asked for a connection first), or a SQLite file's path; default SQLite in the "
             "state dir. Refused on a host whose server.yaml keeps another store")
    add("--engine-prebuilt", dest="llmgw_engine_prebuilt", default=None,
        choices=("auto", "off", "xllamacpp"),
        help="agent.yaml's engine.prebuilt when first written: auto (default) installs "
             "xllamacpp's prebuilt CPU wheel on a CPU node without a cached build, in "
             "seconds; off builds the pinned llama.cpp source (about 10 minutes)")
    add("--engine-cuda", dest="llmgw_engine_cuda", default=None, choices=("auto", "off"),
        help="agent.yaml's engine.cuda when first written: auto (default) makes llama.cpp "
             "with CUDA in the background on a node with NVIDIA GPUs while it serves on "
             "CPU; off keeps the node on CPU")
    add("--plan", dest="llmgw_plan", action="store_true",
        help="pytest provision/ only: probe, say `would ...` for each fix, change nothing")
    add("--steps-json", dest="llmgw_steps_json", default=None, metavar="PATH",
        help="write every step's outcome (step, promise, status, message) to PATH as JSON")
    for name, default in [
        ("admin", defaults.admin), ("agent", defaults.agent), ("gateway", defaults.gateway),
        ("gateway-metrics", defaults.gateway_metrics), ("mirror", defaults.mirror),
        ("mirror-api", defaults.mirror_api),
    ]:
        add(f"--{name}-listen", dest=f"llmgw_{name.replace('-', '_')}_listen", default=default,
            metavar="HOST:PORT", help=f"where the {name.replace('-', ' ')} listens "
            f"(default {default}); used when the host is first provisioned")
    parser.addini("llmgw_steps", type="linelist", default=[],
                  help="modules declaring the steps (`step = Step(...)`), in order; "
                       "default: llmgw's own (install, pki, control_plane, mirror, node, starter)")


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_recorder_key] = Recorder(_terminal.echo(config))
    controller = getattr(config.option, "dist", "no") != "no" and not hasattr(config,
                                                                             "workerinput")
    if controller:  # the xdist controller: its workers run the promises
        config.pluginmanager.register(_WorkersLines(config.stash[_recorder_key]), "llmgw-xdist")


class _WorkersLines:
    """Under xdist the promises run in workers; their lines come home on each test's report
    (user properties) and go into this process's recorder, for the summary and --steps-json."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "call":
            return
        lines: list[tuple[str, str, str, list[str]]] = []
        for status, line in report.user_properties:
            promise, _, message = str(line).partition(" ")
            if status == CHANGE and lines:  # a change line of the `would` before it
                lines[-1][3].append(message)
            else:
                lines.append((status, promise, message, []))
        for status, promise, message, changes in lines:
            self.recorder.record(promise.partition("/")[0], status, message, promise,
                                 tuple(changes))


def registry(config: pytest.Config) -> Registry:
    """The steps this run knows, loaded once (at collection)."""
    if _registry_key not in config.stash:
        config.stash[_registry_key] = load(config.getini("llmgw_steps"))
    return config.stash[_registry_key]


def check_records(config: pytest.Config) -> list[CheckRecord]:
    """The verdicts of this session's promises (none when no promise ran)."""
    run = config.stash.get(_run_key, None)
    return run.records() if run is not None else []


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test asking for `llmgw_promise` runs once per promise, in dependency order."""
    if "llmgw_promise" in metafunc.fixturenames:
        promises = registry(metafunc.config).promises
        metafunc.parametrize("llmgw_promise", promises, ids=[p.id for p in promises])
    if "llmgw_remote" in metafunc.fixturenames and _fleet.hosts(metafunc.config):
        found = _fleet.records(metafunc.config)
        metafunc.parametrize("llmgw_remote", found, ids=[r.test_id for r in found])


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # --hosts checks those hosts instead of this one; without it, the remote test is not
    # there at all (nothing changes).
    remote = bool(_fleet.hosts(config))
    items[:] = [i for i in items
                if not (_promise_of(i) or _is_remote(i)) or _is_remote(i) == remote]
    # Keep the promises in dependency order even if a plugin shuffled the tests: the order
    # is what a person reads (and a `before` is about time, not correctness).
    slots = [i for i, item in enumerate(items) if _promise_of(item)]
    ordered = sorted((items[i] for i in slots), key=lambda it: _order(it))
    for slot, item in zip(slots, ordered, strict=True):
        items[slot] = item


def _is_remote(item: pytest.Item) -> bool:
    return "llmgw_remote" in getattr(item, "fixturenames", ())


def _promise_of(item: pytest.Item) -> Promise | None:
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("llmgw_promise") if callspec else None


def _order(item: pytest.Item) -> int:
    p = _promise_of(item)
    assert p is not None
    return registry(item.config).promises.index(p)


def pytest_report_teststatus(report: pytest.TestReport) -> tuple[str, str, str] | None:
    # A promise that holds has said so in its own line (done/kept); a dot would only break
    # those lines apart. Failures (F) and skips (s) keep their letters.
    if report.when == "call" and report.passed and report.user_properties:
        return "passed", "", "PASSED"
    return None


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    outcomes = config.stash[_recorder_key].outcomes
    if not outcomes:
        return
    terminalreporter.section("llmgw steps")
    for o in outcomes:
        terminalreporter.write_line(o.line())


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = session.config.getoption("llmgw_steps_json", None)
    if path and not hasattr(session.config, "workerinput"):  # an xdist worker: not its file
        session.config.stash[_recorder_key].write_json(path)


@pytest.fixture(scope="session")
def llmgw_recorder(pytestconfig: pytest.Config) -> Recorder:
    """Session: where steps record their done/kept/would/!! lines (summary, --steps-json)."""
    return pytestconfig.stash[_recorder_key]


@pytest.fixture(scope="session")
def llmgw_settings(pytestconfig: pytest.Config) -> HostSettings:
    """Session: the host this run works on (mode, paths, listen addresses, what to skip),
    resolved once from the options and the host's own server.yaml."""
    return HostSettings.from_config(pytestconfig)


@pytest.fixture(scope="session")
def llmgw_apply() -> bool:
    """Session: whether fixes may run. False here (checks/); provision/ overrides it."""
    return False


@pytest.fixture(scope="session")
def llmgw_run(
    pytestconfig: pytest.Config, llmgw_settings: HostSettings, llmgw_recorder: Recorder,
    llmgw_apply: bool,
) -> Iterator[Run]:
    """Session: the run over every promise; each is probed (and fixed) once, on demand.

    Under provision/ it holds the host's lock (STATE/provision.lock) from its first probe
    to the end, so two provisions of one host take turns; --plan takes no lock."""
    host = Host(llmgw_settings, llmgw_recorder, apply=llmgw_apply)
    run = Run(registry(pytestconfig), host, apply=llmgw_apply,
              plan=bool(pytestconfig.getoption("llmgw_plan")))
    pytestconfig.stash[_run_key] = run
    yield run
    run.close()
