"""deploy/grafana/llmgw.json: an importable dashboard (a recent schema, its Prometheus an
input), with the rows the issue names, whose every query parses and reads only metrics
llmgw exports (engine metrics, named by llama.cpp, are checked by the flow test against a
real engine)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from tests.deploy.promql import (
    as_sent,
    dashboard,
    dashboard_exprs,
    exported_names,
    metric_names,
    panels,
    unknown_names,
)

DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
ROWS = ("Fleet", "GPUs", "Models and replicas", "Gateway: latency, throughput and tokens",
        "Keys' usage", "Heartbeats", "Promises")


def test_it_imports_with_a_prometheus_input_and_has_the_rows_asked_for() -> None:
    board = dashboard()
    assert board["schemaVersion"] >= 39
    (source,) = board["__inputs"]
    assert (source["name"], source["type"], source["pluginId"]) == \
        ("DS_PROMETHEUS", "datasource", "prometheus")
    assert [p["title"] for p in board["panels"] if p["type"] == "row"] == list(ROWS)
    every = panels(board)
    assert len({p["id"] for _, p in every}) == len(every), "panel ids are unique"
    for row, p in every:
        assert p["datasource"] == DATASOURCE, p["title"]
        assert p["targets"], f"{row}: {p['title']} has no query"
        assert all(t["datasource"] == DATASOURCE for t in p["targets"]), p["title"]
    assert all(v["datasource"] == DATASOURCE for v in board["templating"]["list"])


def test_every_metric_its_queries_read_is_one_llmgw_exports(tmp_path: Path) -> None:
    exported = exported_names(tmp_path)
    exprs = dashboard_exprs(dashboard())
    assert unknown_names(exprs, exported) == {}
    read = set().union(*map(metric_names, exprs))
    assert {"llmgw_gpu_memory_free_bytes", "llmgw_gateway_request_duration_seconds_bucket",
            "llmgw_promise_ok", "llmgw_node_heartbeat_age_seconds"} <= read, \
        "control: the names are read from the queries at all"


def test_names_are_read_from_promql_as_prometheus_reads_them() -> None:
    """Negative control of the name reader: functions, aggregations, grouping labels,
    matchers, durations and numbers are not names; every selector is."""
    assert metric_names(
        'histogram_quantile(0.99, sum by (model, le) (rate(a_bucket{model=~"$model"}'
        '[$__rate_interval]))) / on(node) group_left(x) b:c > 1e3 and d offset 5m') == \
        {"a_bucket", "b:c", "d"}
    assert metric_names("count(llmgw_gpu_up == 0) or vector(0)") == {"llmgw_gpu_up"}


def test_every_query_parses(promtool: str, tmp_path: Path) -> None:
    """Each query, its variables as Grafana sends them, is a recording rule promtool checks;
    a broken query is refused (the control)."""
    exprs = [as_sent(e) for e in dashboard_exprs(dashboard())]

    def check(queries: list[str]) -> subprocess.CompletedProcess:
        rules = tmp_path / "queries.yml"
        rules.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": [
            {"record": f"query_{i}", "expr": q} for i, q in enumerate(queries)]}]}))
        return subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True,
                              text=True, timeout=60)

    checked = check(exprs)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert not any("$" in e for e in exprs), "every variable is substituted"
    assert check([*exprs, "sum(rate(llmgw_gateway_requests_total[5m])"]).returncode != 0

