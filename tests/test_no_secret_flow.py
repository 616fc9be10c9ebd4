"""No password in a line: credentials fed through a proxy, HF_ENDPOINT and --store into
failing `pytest provision/` runs, and `llmgw check`'s served round and `llmgw store`, reach
none of what they print (the terminal, --steps-json, --junitxml, /healthz, /metrics, the
drift sent to the control plane); each output names the host and port, so the URL was said.
The mirror's own words on a source are tests/mirror/test_downloads.py's, a starter
source's tests/llmgw_harness/test_starter.py's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from llmgw.cli.backup import with_store
from llmgw.host.netaddr import free_port
from tests.hosts import ThrowawayHost

# Only the control plane's configuration: the store is checked before server.yaml is written.
CONFIG_ONLY = ("--no-mirror", "--no-starter", "--no-node", "-k", "control_plane and config")


def _said_where_not_who(outputs: dict[str, str], where: list[str], who: list[str]) -> None:
    """Each output names every host:port in where, and no user or password in who."""
    __tracebackhide__ = True
    for name, text in outputs.items():
        leaked = [w for w in who if w in text]
        assert not leaked, f"{name} says {leaked}:\n{text[-4000:]}"
        unsaid = [w for w in where if w not in text]
        assert not unsaid, f"{name} does not name {unsaid} (control):\n{text[-4000:]}"


def _outputs(run_output: str, steps: list[dict], junit: Path) -> dict[str, str]:
    return {"the terminal": run_output, "--steps-json": json.dumps(steps, ensure_ascii=False),
            "--junitxml": junit.read_text()}


def test_a_store_password_reaches_no_output_of_a_failing_run_or_its_plan(
        tmp_path: Path) -> None:
    host = ThrowawayHost(tmp_path / "state")
    dead = free_port()
    store = f"postgresql://storeuser:store-s3cret@127.0.0.1:{dead}/llmgw"
    junit = tmp_path / "provision.xml"
    run = host.provision(*CONFIG_ONLY, "--store", store, f"--junitxml={junit}", timeout=120)
    assert run.returncode == 1, run.output[-3000:]
    assert f"FAIL  control_plane config: the store postgresql://127.0.0.1:{dead}/llmgw " \
           "refused" in run.output, run.output[-3000:]
    who = ["storeuser", "store-s3cret"]
    _said_where_not_who(_outputs(run.output, run.steps, junit), [f"127.0.0.1:{dead}"], who)

    plan_junit = tmp_path / "plan.xml"
    plan = host.provision(*CONFIG_ONLY, "--store", store, "--plan", f"--junitxml={plan_junit}",
                          timeout=120)
    assert plan.returncode == 1 and "would control_plane" in plan.output, plan.output[-3000:]
    _said_where_not_who(_outputs(plan.output, plan.steps, plan_junit),
                        [f"127.0.0.1:{dead}"], who)


def test_the_proxys_and_the_hubs_passwords_reach_no_output_of_a_failing_run(
        tmp_path: Path) -> None:
    """HF_ENDPOINT and HTTPS_PROXY with `user:password@`, the proxy dead: the starter's
    source check fails naming the hub and the proxy by host and port."""
    host = ThrowawayHost(tmp_path / "state")
    hub, proxy = free_port(), free_port()
    env = {"HF_ENDPOINT": f"https://hubuser:hub-s3cret@127.0.0.1:{hub}",
           "HTTPS_PROXY": f"http://proxyuser:proxy-s3cret@127.0.0.1:{proxy}",
           "NO_PROXY": "", "HF_TOKEN": ""}
    junit = tmp_path / "provision.xml"
    try:
        run = host.provision("-k", "starter and source", f"--junitxml={junit}", env=env,
                             timeout=300)
    finally:
        host.down()
    assert run.returncode == 1, run.output[-3000:]
    assert f"the model hub (https://127.0.0.1:{hub}) cannot be reached from here through " \
           f"the proxy http://127.0.0.1:{proxy} (" in run.output, run.output[-3000:]
    _said_where_not_who(_outputs(run.output, run.steps, junit),
                        [f"127.0.0.1:{hub}", f"127.0.0.1:{proxy}"],
                        ["hubuser", "hub-s3cret", "proxyuser", "proxy-s3cret"])


def test_a_store_password_reaches_neither_the_served_checks_nor_llmgw_store(
        tmp_path: Path) -> None:
    """A server.yaml whose `store:` carries a password (set by hand, the store away): the
    round `llmgw check --serve` runs, as /healthz, /metrics and the drift it sends say it;
    and `llmgw store migrate --to` a URL with a password that refuses."""
    from llmgw.cli.watch import Watch, check_round, drift_report, healthz, metrics

    host = ThrowawayHost(tmp_path / "state")
    made = host.provision(*CONFIG_ONLY, timeout=120)
    assert made.returncode == 0, made.output[-3000:]
    server_yaml = host.state_dir / "etc/server.yaml"

    from llmgw.config import load_server
    from llmgw.store import Store

    Store(load_server(server_yaml).store_at()).close()  # its schema, as the control plane's
    dead = free_port()
    migrate = subprocess.run(
        [sys.executable, "-m", "llmgw", "store", "migrate", "--mode=local",
         f"--state-dir={host.state_dir}",
         "--to", f"postgresql://miguser:mig-s3cret@127.0.0.1:{dead}/llmgw"],
        capture_output=True, text=True, timeout=120)
    assert migrate.returncode != 0, migrate.stdout + migrate.stderr
    _said_where_not_who({"llmgw store migrate": migrate.stdout + migrate.stderr},
                        [f"127.0.0.1:{dead}"], ["miguser", "mig-s3cret"])

    store = f"postgresql://storeuser:store-s3cret@127.0.0.1:{dead}/llmgw"
    server_yaml.write_text(with_store(server_yaml.read_text(), store))
    result = Watch(check_round(str(host.state_dir), "local")).round()
    assert not result.error and result.failed(), result
    who = ["storeuser", "store-s3cret"]
    _said_where_not_who({"/healthz": healthz(result)[1],
                         "the drift report": json.dumps(drift_report(result))},
                        [f"127.0.0.1:{dead}"], who)
    _said_where_not_who({"/metrics": metrics(result)}, [], who)  # no message: labels only
