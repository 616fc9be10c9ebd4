"""The contract is the one place states and paths are spelled, and the agent's only tie to
the control plane's code."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from llmgw.contract import (
    LIVE_REPLICA_STATES,
    REPORTED_REPLICA_STATES,
    AgentPaths,
    EngineState,
    NodeState,
    ReplicaState,
)

SRC = Path(__file__).resolve().parents[1] / "src" / "llmgw"
STATE_WORDS = {str(s) for enum in (ReplicaState, NodeState, EngineState) for s in enum}


def imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def state_literals(paths: list[Path]) -> list[str]:
    """Every string constant that spells a state, as FILE:LINE 'WORD'."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in STATE_WORDS:
                found.append(f"{path.name}:{node.lineno} {node.value!r}")
    return found


def test_the_agent_imports_nothing_of_the_control_plane_but_the_contract() -> None:
    modules = sorted((SRC / "agent").glob("*.py"))
    assert modules
    reached = {f"{m.name}: {imp}" for m in modules for imp in imported_modules(m)
               if imp.startswith("llmgw.control")}
    assert not reached, f"the agent imports the control plane's code: {sorted(reached)}"


def test_the_import_walk_sees_an_import_of_the_control_plane(tmp_path: Path) -> None:
    """Negative control: a module that imports llmgw.control is caught."""
    module = tmp_path / "bad.py"
    module.write_text("from llmgw.control.agent_api import token_hash\nimport llmgw.control\n")
    assert imported_modules(module) == {"llmgw.control.agent_api", "llmgw.control"}


@pytest.mark.parametrize("folder", ["control", "agent", "commands"])
def test_states_are_spelled_only_in_the_contract(folder: str) -> None:
    """Code compares states with the enums; a quoted state word outside the contract is a
    second spelling that can drift."""
    assert state_literals(sorted((SRC / folder).glob("*.py"))) == []


def test_the_literal_scan_finds_a_quoted_state(tmp_path: Path) -> None:
    """Negative control for the scan above."""
    module = tmp_path / "replicas.py"
    module.write_text('def ready(r):\n    return r["state"] == "ready"\n')
    assert state_literals([module]) == ["replicas.py:2 'ready'"]


def test_a_member_equals_its_word_as_stored_and_sent() -> None:
    assert ReplicaState.READY == "ready" and f"{NodeState.NOT_READY}" == "not_ready"
    assert ReplicaState.STOPPED not in LIVE_REPLICA_STATES
    assert REPORTED_REPLICA_STATES < LIVE_REPLICA_STATES
    assert ReplicaState.PENDING not in REPORTED_REPLICA_STATES


def test_the_join_paths_are_the_ones_a_client_without_a_certificate_reaches() -> None:
    from llmgw.control.agent_api import _ANONYMOUS_PATHS

    assert {path for _, path in _ANONYMOUS_PATHS} == {
        AgentPaths.JOIN, AgentPaths.JOIN_CA, AgentPaths.JOIN_CONTROL_PLANE, AgentPaths.CRL}


def untyped_dicts(root: Path) -> int:
    """How often `dict[str, Any]` is spelled under root: data that crosses a boundary has
    a record in llmgw.contract instead."""
    return sum(p.read_text().count("dict[str, Any]") for p in root.rglob("*.py"))


def test_untyped_dicts_stay_few(tmp_path: Path) -> None:
    assert untyped_dicts(SRC) < 20
    (tmp_path / "m.py").write_text("x: dict[str, Any] = {}\ny: dict[str, Any] = {}\n")
    assert untyped_dicts(tmp_path) == 2  # negative control: the count sees them


def test_one_explainer_names_key_found_value_and_rule_for_models_and_typed_dicts() -> None:
    """server.yaml and a heartbeat are refused in the same words (contract.explain)."""
    from pydantic import TypeAdapter, ValidationError

    from llmgw.config import ServerConfig
    from llmgw.contract.explain import problems
    from llmgw.contract.records import ReplicaRecord

    with pytest.raises(ValidationError) as yaml_error:
        ServerConfig.model_validate({"tokens": [12345], "colour": "red"})
    said = problems(yaml_error.value, ServerConfig)
    assert "tokens.0 is 12345: Input should be a valid string" in said
    assert "colour is not a known key (known here: admin_listen," in said
    with pytest.raises(ValidationError) as row_error:
        TypeAdapter(ReplicaRecord).validate_python(
            {"id": "r", "model": "m", "node": "", "profile": "cpu", "state": "paused"})
    assert problems(row_error.value).startswith("state is 'paused': Input should be")


@pytest.mark.parametrize("model_name, spec_name", [
    ("Model", "ModelSpec"), ("Profile", "ProfileSpec"), ("Scaling", "ScalingSpec"),
    ("Geometry", "Geometry"),
])
def test_the_catalogs_rules_and_the_dicts_readers_hold_have_the_same_fields(
        model_name: str, spec_name: str) -> None:
    """contract.catalog's models (the rules, checked on the way in) dump to exactly the
    TypedDicts of contract.records that the gateway, the scheduler and the store read: a
    field added to one and not the other fails here."""
    import typing

    from llmgw.contract import catalog, records

    model = getattr(catalog, model_name)
    spec = getattr(records, spec_name)
    assert set(model.model_fields) == set(typing.get_type_hints(spec)), \
        f"catalog.{model_name} and records.{spec_name} differ"


def test_negative_control_a_field_the_dicts_lack_is_seen() -> None:
    import typing

    from llmgw.contract import catalog, records

    fields = set(catalog.Model.model_fields) | {"colour"}
    assert fields != set(typing.get_type_hints(records.ModelSpec))
