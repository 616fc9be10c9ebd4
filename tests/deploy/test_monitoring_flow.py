"""A real Prometheus (Debian's) scraping a provisioned host as deploy/prometheus/prometheus.yml
says, with the shipped rules, their `for:` shortened: a promise broken on the host (its
mirror stopped) raises its alert; every query of the Grafana dashboard runs, and the
fleet, GPU and gateway panels have series (a stand-in NVML gives the node its GPU)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from llmgw.host.netaddr import free_port
from tests.deploy.promql import (
    RULES,
    SCRAPE_CONFIG,
    as_sent,
    dashboard,
    dashboard_exprs,
    exported_names,
    metric_names,
    panels,
)
from tests.hosts import ThrowawayHost

pytestmark = pytest.mark.slow

STANDIN = Path(__file__).resolve().parents[1] / "standin_nvml"
SHORT_FOR = "2s"
# Rows whose every query must return series on this host once requests went through.
ROWS_WITH_SERIES = ("Fleet", "GPUs", "Gateway: latency, throughput and tokens")


def wait_for(what: str, probe: Callable[[], Any], timeout_s: float,
             done: Callable[[Any], bool] = bool) -> Any:
    """probe's first answer that is done (truthy by default); a wait that runs out names
    what it waited for and the last answer it saw."""
    __tracebackhide__ = True
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        last = probe()
        if done(last):
            return last
        time.sleep(0.5)
    raise AssertionError(f"waited {timeout_s:.0f}s for {what}; last seen: {last!r}")


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory, tiny_gguf: tuple[Path, str],
         llama_server: str) -> Iterator[ThrowawayHost]:
    """Module: one host, provisioned with the tiny GGUF as its starter, a stand-in H100,
    and `llmgw check --serve` every second (its port in check_port)."""
    h = ThrowawayHost(tmp_path_factory.mktemp("monitored") / "state")
    h.check_port = free_port()  # type: ignore[attr-defined]
    first = h.provision(f"--starter-source={tiny_gguf[0].as_uri()}",
                        f"--check-serve=127.0.0.1:{h.check_port}", "--check-interval=1",
                        env={"PYTHONPATH": str(STANDIN)})
    try:
        assert first.returncode == 0, first.output[-4000:]
        yield h
    finally:
        h.down()


def scrape_config(host: ThrowawayHost, rules: Path) -> dict[str, Any]:
    """The shipped scrape configuration, pointed at this host every second."""
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(rules)]
    ports = {"llmgw": host.ports["admin"], "llmgw-mirror": host.ports["mirror-api"],
             "llmgw-check": host.check_port}  # type: ignore[attr-defined]
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": [f"127.0.0.1:{ports.pop(job['job_name'])}"]}]
        if "authorization" in job:
            job["authorization"]["credentials_file"] = str(host.token_path)
    assert not ports, f"jobs the shipped configuration lacks: {ports}"
    return config


@pytest.fixture(scope="module")
def prometheus(host: ThrowawayHost, prometheus_binary: str,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Module: a Prometheus on a free loopback port with a temporary data dir, scraping the
    host with the shipped rules, every `for:` shortened to SHORT_FOR; its URL."""
    root = tmp_path_factory.mktemp("prometheus")
    rules = root / "llmgw-rules.yml"
    rules.write_text(re.sub(r"(?m)^(\s+for:) \S+$", rf"\1 {SHORT_FOR}", RULES.read_text()))
    config = root / "prometheus.yml"
    config.write_text(yaml.safe_dump(scrape_config(host, rules)))
    url = f"http://127.0.0.1:{free_port()}"
    log = (root / "prometheus.log").open("w")
    proc = subprocess.Popen([prometheus_binary, f"--config.file={config}",
                             f"--storage.tsdb.path={root / 'data'}",
                             f"--web.listen-address={url.removeprefix('http://')}"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(f"Prometheus ready at {url} (its log: {root / 'prometheus.log'})",
                 lambda: proc.poll() is None and _ready(url), 60)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/-/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def query(prometheus: str, expr: str) -> list[dict[str, Any]]:
    """The instant result of expr; AssertionError with Prometheus's words on an error."""
    __tracebackhide__ = True
    answer = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert answer["status"] == "success", f"{expr}: {answer.get('error')}"
    return answer["data"]["result"]


def promise_alerts(prometheus: str, promise: str) -> list[str]:
    """The states (pending, firing) of LlmgwPromiseFailing for one promise."""
    alerts = httpx.get(f"{prometheus}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
    return [a["state"] for a in alerts if a["labels"]["alertname"] == "LlmgwPromiseFailing"
            and a["labels"].get("promise") == promise]


def supervisorctl(host: ThrowawayHost, *args: str) -> None:
    subprocess.run([sys.executable, "-m", "supervisor.supervisorctl", "-c",
                    str(host.state_dir / "supervisord.conf"), *args],
                   check=True, capture_output=True, timeout=60)


def chat(host: ThrowawayHost, model: str = "qwen-0.5b") -> int:
    answer = httpx.post(f"http://127.0.0.1:{host.ports['gateway']}/v1/chat/completions",
                        json={"model": model, "max_tokens": 4,
                              "messages": [{"role": "user", "content": "hi"}]},
                        headers={"Authorization": f"Bearer {host.gateway_key}"}, timeout=60)
    return answer.status_code


def empty_queries(prometheus: str, node: str = ".*") -> list[str]:
    """The panels (row: title: query) of ROWS_WITH_SERIES whose query returns no series."""
    empty = []
    for row, p in panels(dashboard()):
        for t in p["targets"] if row in ROWS_WITH_SERIES else ():
            expr = as_sent(t["expr"].replace("$node", node))
            if not query(prometheus, expr):
                empty.append(f"{row}: {p['title']}: {expr}")
    return empty


def test_every_dashboard_query_runs_and_the_fleet_gpu_and_gateway_panels_have_series(
        host: ThrowawayHost, prometheus: str, tmp_path: Path) -> None:
    """A few requests through the gateway (one for a model that does not exist, a 404),
    then every query of the dashboard answers without an error, those of the fleet, GPU and
    gateway rows with series, and every metric it names is one Prometheus scraped (the
    engines' from llama-server itself), or one llmgw writes only when something fails (a
    promise's since when). The control: for a node that does not exist, the GPU panels are
    empty."""
    assert chat(host) == 200
    wait_for("the first request's counters in Prometheus",
             lambda: query(prometheus, "llmgw_gateway_requests_total"), 30)
    assert [chat(host) for _ in range(3)] == [200] * 3
    assert chat(host, model="no-such-model") == 404
    wait_for("series in every fleet, GPU and gateway panel (the last are those without)",
             lambda: empty_queries(prometheus), 60, done=lambda empty: not empty)
    for expr in dashboard_exprs(dashboard()):
        query(prometheus, as_sent(expr))
    scraped = set(httpx.get(f"{prometheus}/api/v1/label/__name__/values",
                            timeout=10).json()["data"])
    named = set().union(*(metric_names(e) for e in dashboard_exprs(dashboard())))
    assert named - scraped - exported_names(tmp_path) == set()
    assert {n for n in named if n.startswith("llamacpp:")} <= scraped
    unplaced = [e for e in empty_queries(prometheus, node="no-such-node")
                if e.startswith("GPUs: ")]
    gpu_queries = [t["expr"] for row, p in panels(dashboard()) if row == "GPUs"
                   for t in p["targets"]]
    assert len(unplaced) == len([q for q in gpu_queries if "or vector(0)" not in q]) > 0, \
        unplaced


def firing(prometheus: str) -> list[dict[str, str]]:
    alerts = httpx.get(f"{prometheus}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
    return [a["labels"] for a in alerts if a["state"] == "firing"]


def gpu_engine_state(host: ThrowawayHost) -> str:
    """The node's llamacpp-cuda state as the control plane has it ('' until reported)."""
    (node,) = host.admin().nodes()
    return next((e["state"] for e in node["provision"] if e["engine"] == "llamacpp-cuda"), "")


def test_on_the_healthy_host_only_the_stand_in_gpus_failed_engine_raises_an_alert(
        host: ThrowawayHost, prometheus: str) -> None:
    """The stand-in card has no CUDA driver behind it, so the node's llamacpp-cuda fails:
    LlmgwEngineFailed fires for it, a real alert for a real failure (and does not, should
    the engine settle otherwise). Nothing else is wrong here, so no other alert fires
    (promises apart: a failed GPU engine may fail one). Every shipped rule evaluates."""
    making = ("", "pending", "downloading", "building", "checking")
    state = wait_for("llamacpp-cuda's state to settle", lambda: gpu_engine_state(host), 120,
                     done=lambda s: s not in making)

    def engine_alerts() -> list[dict[str, str]]:
        return [a for a in firing(prometheus) if a["alertname"] == "LlmgwEngineFailed"]

    if state == "failed":
        wait_for("LlmgwEngineFailed for llamacpp-cuda firing", engine_alerts, 60)
        assert [a["engine"] for a in engine_alerts()] == ["llamacpp-cuda"]
    else:
        time.sleep(3)  # a scrape, an evaluation and the short for
        assert engine_alerts() == [], state
    others = [a for a in firing(prometheus)
              if a["alertname"] not in ("LlmgwEngineFailed", "LlmgwPromiseFailing")]
    assert others == []
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    evaluated = httpx.get(f"{prometheus}/api/v1/rules", timeout=10).json()["data"]["groups"]
    assert len(evaluated[0]["rules"]) == len(rules), "every shipped rule is loaded"
    assert all(r["health"] == "ok" for r in evaluated[0]["rules"]), evaluated


def test_a_stopped_mirror_raises_its_promise_alert_within_the_short_for(
        host: ThrowawayHost, prometheus: str) -> None:
    """Silent while the mirror's promise holds (seen held in Prometheus first); the mirror
    stopped, `llmgw check --serve` finds the promise failing and LlmgwPromiseFailing for
    mirror/service is pending or firing within a round, a scrape and the short `for`."""
    held = 'llmgw_promise_ok{promise="mirror/service"} == 1'
    wait_for("mirror/service seen holding", lambda: query(prometheus, held), 60)
    assert promise_alerts(prometheus, "mirror/service") == []
    supervisorctl(host, "stop", "llmgw-mirror")
    try:
        stopped = time.monotonic()
        states = wait_for("LlmgwPromiseFailing{promise=mirror/service}",
                          lambda: promise_alerts(prometheus, "mirror/service"), 90)
        print(f"alert {states[0]} {time.monotonic() - stopped:.1f}s after the mirror stopped")
        assert states[0] in ("pending", "firing")
        wait_for("the alert firing after its short for",
                 lambda: promise_alerts(prometheus, "mirror/service"), 30,
                 done=lambda states: states == ["firing"])
    finally:
        supervisorctl(host, "start", "llmgw-mirror")
