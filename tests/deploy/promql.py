"""The metric names a PromQL expression reads, and the names llmgw exports, rendered from
its own collectors over a store with one of everything in it."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import httpx
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from llmgw.cli import watch
from llmgw.control.metrics import ControlPlaneMetrics, gateway_metrics
from llmgw.gateway.metrics import GatewayMetrics
from llmgw.host import pki
from llmgw.mirror._downloads import Manager
from llmgw.mirror._metrics import ServedCounter
from llmgw.mirror._metrics import registry as mirror_registry
from llmgw.store import Store

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "llmgw-rules.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "llmgw-rules.test.yml"
SCRAPE_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "llmgw.json"
# Where each metric family comes from that the engines, not llmgw, name.
ENGINE_PREFIX = "llamacpp:"

# Words of PromQL that look like names: binary operators, modifiers, grouping clauses.
_KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left",
             "group_right", "bool", "offset", "inf", "nan"}
# Grafana's variables, as a query sent to Prometheus spells them.
GRAFANA_VARIABLES = {"$__rate_interval": "30s", "$__interval": "15s", "$__range": "5m",
                     "$node": ".*", "$model": ".*"}


def metric_names(expr: str) -> set[str]:
    """The metric names expr selects: what is left once strings, label matchers, range
    brackets and grouping clauses are taken out, minus functions, aggregations (a name
    followed by '(') and keywords."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        if m.start() and (text[m.start() - 1].isdigit() or text[m.start() - 1] in ".$"):
            continue  # 1e3's e3, a $variable
        if m.group() in _KEYWORDS or text[m.end():].lstrip().startswith("("):
            continue
        names.add(m.group())
    return names


def as_sent(expr: str) -> str:
    """expr with Grafana's variables replaced as Grafana would send it ($model as All)."""
    for name in sorted(GRAFANA_VARIABLES, key=len, reverse=True):
        expr = expr.replace(name, GRAFANA_VARIABLES[name])
    return expr


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(board: dict) -> list[tuple[str, dict]]:
    """Every panel that is not a row, with the title of the row it is under."""
    found, row = [], ""
    for p in board["panels"]:
        if p["type"] == "row":
            row = p["title"]
            found += [(row, inner) for inner in p.get("panels", [])]
        else:
            found.append((row, p))
    return found


def dashboard_exprs(board: dict) -> list[str]:
    """Every PromQL expression of the dashboard: its panels' targets and its variables'
    queries (label_values(METRIC, LABEL) read as the selector METRIC)."""
    exprs = [t["expr"] for _, p in panels(board) for t in p.get("targets", [])]
    for var in board["templating"]["list"]:
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = re.fullmatch(r"label_values\((.+),\s*\w+\)", query)
        exprs.append(m.group(1) if m else query)
    return exprs


def rule_exprs() -> list[str]:
    return [r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def unknown_names(exprs: list[str], exported: set[str]) -> dict[str, set[str]]:
    """Each expression's names that are not exported, by expression; engine names apart."""
    missing = {}
    for expr in exprs:
        names = {n for n in metric_names(expr) if not n.startswith(ENGINE_PREFIX)}
        if names - exported:
            missing[expr] = names - exported
    return missing


def _sample_names(text: str) -> set[str]:
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def exported_names(tmp_path: Path) -> set[str]:
    """Every sample name llmgw's own collectors write (counters' _total, histograms'
    _bucket, _sum and _count included): the control plane's over a store holding a node
    with a GPU and engines, a replica, a certificate and a control plane scheduling; the
    gateway's after a request; the mirror's; `llmgw check --serve`'s with a failing promise."""
    store = Store(tmp_path / "control.db")
    store.add_model({"name": "m", "aliases": [], "source": "http://x/m.gguf", "profiles": []})
    store.record_heartbeat("n1", {
        "engines": ["llamacpp"],
        "gpus": [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "memory_mb": 81559,
                  "uuid": "GPU-a", "class": "h100-80gb", "memory_free_mb": 80000}],
        "provision": [{"engine": "llamacpp", "state": "ready"}],
        "replica_state_changes": {"r1": {"model": "m", "to": {"ready": 1}}}})
    store.put_replica({"id": "r1", "model": "m", "node": "n1", "profile": "cpu",
                       "state": "ready", "endpoint": "", "api_key": "k"})
    store.add_cert("01", "n1", 2e9)
    store.beat_control_plane("cp", "https://a:7443", "http://a:9090")
    store.acquire_lease("cp", 10.0)
    ca_pem, _ = pki.create_ca().write(tmp_path, "ca")
    control = ControlPlaneMetrics(store, 30.0, certificates={"ca": str(ca_pem)})
    texts = [generate_latest(control.registry).decode()]
    gateway = CollectorRegistry()
    counted = GatewayMetrics(gateway)
    counted.observe("m", 200, 0.0, (3, 5), key="k")
    counted.load("m", "failed", 2.0)
    texts.append(generate_latest(gateway).decode())

    async def gateway_up() -> str:
        async with httpx.AsyncClient() as client:
            return await gateway_metrics(client, "")
    texts.append(asyncio.run(gateway_up()))
    (tmp_path / "models").mkdir()
    served = ServedCounter()
    served.sent(200, 10)
    texts.append(generate_latest(mirror_registry(Manager(tmp_path / "models", "http://x"),
                                                 served)).decode())
    record = {"step": "mirror", "promise": "service", "status": "failed", "message": "x"}
    texts.append(watch.metrics(watch.Result([record], 1.0, 1.0, "", {"mirror/service": 1.0})))
    store.close()
    return set().union(*map(_sample_names, texts))
