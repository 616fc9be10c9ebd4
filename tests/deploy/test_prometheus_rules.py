"""deploy/prometheus/llmgw-rules.yml: promtool checks it and runs its unit tests (each alert
fires with its condition and stays silent without it); every rule waits (`for:`), says what
is wrong (summary) and where to read what to do (a runbook section that docs/operations.md
has); every metric it reads is one llmgw exports."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import yaml

from tests.deploy.promql import (
    ROOT,
    RULE_TESTS,
    RULES,
    SCRAPE_CONFIG,
    exported_names,
    rule_exprs,
    unknown_names,
)

OPERATIONS = ROOT / "docs" / "operations.md"


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def promtool_run(promtool: str, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([promtool, *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd)


def test_promtool_checks_the_rules_and_refuses_a_broken_one(promtool: str,
                                                             tmp_path: Path) -> None:
    checked = promtool_run(promtool, "check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(rules())} rules found" in checked.stdout
    broken = tmp_path / "rules.yml"
    broken.write_text(RULES.read_text().replace("expr: llmgw_store_up == 0",
                                                "expr: llmgw_store_up ==", 1))
    refused = promtool_run(promtool, "check", "rules", str(broken))
    assert refused.returncode != 0 and "parse error" in refused.stdout + refused.stderr


def test_each_alert_fires_with_its_condition_and_stays_silent_without_it(
        promtool: str) -> None:
    """promtool test rules passes, and the tests cover every alert both ways: a case where
    it fires (exp_alerts named) and one where it is silent (exp_alerts: [])."""
    tested = promtool_run(promtool, "test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    cases = [c for t in yaml.safe_load(RULE_TESTS.read_text())["tests"]
             for c in t.get("alert_rule_test", [])]
    fires = {c["alertname"] for c in cases if c["exp_alerts"]}
    silent = {c["alertname"] for c in cases if not c["exp_alerts"]}
    alerts = {r["alert"] for r in rules()}
    assert alerts - fires == set(), "alerts without a test where they fire"
    assert alerts - silent == set(), "alerts without a test where they stay silent"


def test_a_rule_whose_condition_changed_fails_its_unit_test(promtool: str,
                                                            tmp_path: Path) -> None:
    """Negative control: the disk alert at 1% instead of 10% no longer fires at 5% left,
    and the disk full of 5% left no longer stays silent below an alert at 60%."""
    for before, after in (("< 0.10", "< 0.01"), ("< 0.10", "< 0.60")):
        (tmp_path / RULES.name).write_text(RULES.read_text().replace(before, after, 1))
        shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
        tested = promtool_run(promtool, "test", "rules", RULE_TESTS.name, cwd=tmp_path)
        assert tested.returncode != 0, after
        assert "LlmgwMirrorDiskNearlyFull" in tested.stdout + tested.stderr


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a document's headings: lower case, punctuation but - and _
    dropped, spaces as -."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#{1,6} (.+)$", markdown, flags=re.M)}


def badly_documented(rules: list[dict], docs: str) -> list[str]:
    """Rules without a for:, a summary, or a runbook naming a section that docs has."""
    anchors = github_anchors(docs)
    bad = []
    for r in rules:
        notes = r.get("annotations", {})
        runbook = notes.get("runbook", "")
        path, _, anchor = runbook.partition("#")
        if not r.get("for") or not notes.get("summary") or path != "docs/operations.md" \
                or anchor not in anchors:
            bad.append(r["alert"])
    return bad


def test_every_rule_waits_says_what_is_wrong_and_where_to_read_what_to_do() -> None:
    assert badly_documented(rules(), OPERATIONS.read_text()) == []
    assert {r["labels"]["severity"] for r in rules()} <= {"warning", "critical"}


def test_a_runbook_naming_no_section_is_caught() -> None:
    """Negative control for the check above: a missing section, and a missing for:."""
    rule = {"alert": "A", "for": "1m", "annotations": {
        "summary": "s", "runbook": "docs/operations.md#alert-rules"}}
    assert badly_documented([rule], "## Alert rules\n") == []
    assert badly_documented([rule], "## Other\n") == ["A"]
    assert badly_documented([{**rule, "for": None}], "## Alert rules\n") == ["A"]


def test_every_metric_the_rules_read_is_one_llmgw_exports(tmp_path: Path) -> None:
    exported = exported_names(tmp_path)
    assert unknown_names(rule_exprs(), exported) == {}
    assert unknown_names(["rate(llmgw_gateway_request_total[5m])"], exported) == {
        "rate(llmgw_gateway_request_total[5m])": {"llmgw_gateway_request_total"}}, \
        "control: a misspelled name is caught"


def test_the_shipped_scrape_configuration_is_valid_and_loads_the_rules(
        promtool: str, tmp_path: Path) -> None:
    """deploy/prometheus/prometheus.yml, its files moved to here, passes promtool."""
    token = tmp_path / "admin-token"
    token.write_text("t\n")
    config = tmp_path / "prometheus.yml"
    config.write_text(SCRAPE_CONFIG.read_text()
                      .replace("/etc/prometheus/llmgw-rules.yml", str(RULES))
                      .replace("/etc/llmgw/admin-token", str(token)))
    checked = promtool_run(promtool, "check", "config", str(config))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(rules())} rules found" in checked.stdout
