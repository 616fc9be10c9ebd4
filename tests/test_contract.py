"""The contract is the one place states and paths are spelled, and the agent's only tie to
the control plane's code."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Annotated

import pytest
from pydantic import Field
from typing_extensions import TypedDict

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


def record_fields(c: type) -> frozenset[str] | None:
    """The field names of a record class that is not a TypedDict: a pydantic model, a
    dataclass or a NamedTuple; None for any other class."""
    import dataclasses

    from pydantic import BaseModel

    if issubclass(c, BaseModel):
        return frozenset(c.model_fields)
    if dataclasses.is_dataclass(c):
        return frozenset(f.name for f in dataclasses.fields(c))
    if issubclass(c, tuple) and hasattr(c, "_fields"):  # a NamedTuple
        return frozenset(c._fields)
    return None


def mirrored_records(classes: list[type]) -> list[str]:
    """Pairs of a record class (pydantic model, dataclass or NamedTuple) and a TypedDict
    with the same keys (two or more): one record written twice, which can drift apart."""
    from typing_extensions import is_typeddict  # typing's misses typing_extensions' TypedDict

    dicts = {c: frozenset(c.__required_keys__ | c.__optional_keys__) for c in classes
             if is_typeddict(c)}
    records = {c: keys for c in classes
               if not is_typeddict(c) and (keys := record_fields(c)) and len(keys) >= 2}
    return sorted(f"{r.__module__}.{r.__name__} = {d.__module__}.{d.__name__}"
                  for r, keys in records.items() for d, same in dicts.items() if keys == same)


def test_each_record_is_defined_once() -> None:
    """The catalog model, the drift report, an engine's status, a model version in the
    mirror: one TypedDict carries the fields, their rules and defaults; no pydantic model,
    dataclass or NamedTuple beside it repeats them."""
    from tests.sourceclasses import classes_of, llmgw_modules

    assert mirrored_records(classes_of(llmgw_modules())) == []


def test_negative_control_a_record_mirroring_a_typed_dict_is_seen(tmp_path: Path) -> None:
    """A model, a dataclass and a NamedTuple each repeating a TypedDict's keys are seen;
    one with a key more, and a class that is no record, are not."""
    import importlib.util

    from tests.sourceclasses import classes_of

    (tmp_path / "twice.py").write_text(
        "from dataclasses import dataclass\nfrom typing import NamedTuple\n"
        "from pydantic import BaseModel\nfrom typing_extensions import TypedDict\n"
        "class Report(BaseModel):\n    checked: float\n    promises: int\n    failing: list\n"
        "class DriftReport(TypedDict):\n    checked: float\n    promises: int\n"
        "    failing: list\n"
        "class EngineStatus(TypedDict, total=False):\n    engine: str\n    state: str\n"
        "@dataclass(frozen=True)\nclass Status:\n    engine: str\n    state: str = ''\n"
        "class Pair(NamedTuple):\n    engine: str\n    state: str\n"
        "@dataclass\nclass Wider:\n    engine: str\n    state: str\n    detail: str\n"
        "class Plain:\n    engine = 'e'\n    state = 's'\n")
    spec = importlib.util.spec_from_file_location("twice", tmp_path / "twice.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert mirrored_records(classes_of([module])) == [
        "twice.Pair = twice.EngineStatus", "twice.Report = twice.DriftReport",
        "twice.Status = twice.EngineStatus"]


def test_what_a_new_model_leaves_out_it_gets_as_declared_and_so_does_an_old_row() -> None:
    """The admin API fills in a left-out field from its annotation (CATALOG_MODEL); a row
    stored before the field existed reads with the same value (SPEC_DEFAULTS, read off
    the same annotations)."""
    import json

    from llmgw.contract.catalog import CATALOG_MODEL, SPEC_DEFAULTS
    from llmgw.store.replicas import stored_spec

    given = {"name": "m", "source": "http://x/m.gguf",
             "profiles": [{"name": "cpu", "engine": "llamacpp"}]}
    added = CATALOG_MODEL.validate_python(given)
    assert set(SPEC_DEFAULTS) == set(added) - set(given)
    assert added == {**given, **SPEC_DEFAULTS, "profiles": added["profiles"]}
    assert SPEC_DEFAULTS["scaling"] == {"min": 1, "max": 1, "idle_s": 900}
    assert SPEC_DEFAULTS["geometry"]["block_count"] == 0 and len(SPEC_DEFAULTS["geometry"]) == 8
    assert added["profiles"][0]["priority"] == 100
    assert stored_spec(json.dumps(given)) == {**added, "profiles": given["profiles"]}
    # A row stored before scaling.idle_s existed reads with its default too.
    old_scaling = {**given, "scaling": {"min": 0, "max": 2}}
    assert stored_spec(json.dumps(old_scaling))["scaling"] == {"min": 0, "max": 2, "idle_s": 900}


class _Record(TypedDict):
    needed: str
    tags: Annotated[list[str], Field(default_factory=list)]
    count: Annotated[int, Field(default=3, ge=0)]


def test_defaults_lists_only_keys_with_a_default_and_never_shares_one() -> None:
    from llmgw.contract.catalog import defaults

    first = defaults(_Record)
    assert first == {"tags": [], "count": 3}  # the control: `needed` has none
    first["tags"].append("x")
    assert defaults(_Record)["tags"] == []


# What `llmgw models add` prints of a refused model (after "POST /api/v1/models refused: "),
# word for word as before the catalog model became one TypedDict.
REFUSALS = [
    ({"scaling": {"min": 3}},
     "scaling is {'min': 3}: scaling.min (3) is above scaling.max (1)"),
    ({"aliases": ["ok", "B!"]},
     "aliases is ['ok', 'B!']: name 'B!' must be lower-case letters, digits, '.', '_' or "
     "'-', starting with a letter or digit, at most 128 characters"),
    ({"aliases": ["m"]},
     "the whole value is {'name': 'm', 'source': 'http://x/m.gguf', 'profiles': [{'name': "
     "'cpu', 'engine': 'llamacpp'}], 'aliases': ['m']}: alias 'm' repeats the model's own "
     "name"),
    ({"profiles": [{"name": "a", "engine": "llamacpp"}, {"name": "a", "engine": "llamacpp"}]},
     "the whole value is {'name': 'm', 'source': 'http://x/m.gguf', 'profiles': [{'name': "
     "'a', 'engine': 'llamacpp'}, {'name': 'a', 'engine': 'llamacpp'}]}: profile names "
     "must be unique; repeated: a"),
    ({"profiles": [{"name": "", "engine": "vllm", "extra": 1}]},
     "profiles.0.name is '': String should have at least 1 character; profiles.0.engine is "
     "'vllm': engine 'vllm' is unknown; llmgw serves llamacpp; profiles.0.extra is not a "
     "known key"),
    ({"source": "ftp://x", "sha256": "abc", "colour": "red"},
     "source is 'ftp://x': source 'ftp://x' must start with one of hf:, https://, http://; "
     "sha256 is 'abc': sha256 must be 64 lower-case hex digits, or empty when unknown; "
     "colour is not a known key"),
    ({"scaling": {"min": 65, "max": 0}, "geometry": {"zz": 1}},
     "scaling.min is 65: Input should be less than or equal to 64; scaling.max is 0: Input "
     "should be greater than or equal to 1; geometry.zz is not a known key"),
    ({"profiles": [{"name": "p", "engine": "llamacpp", "args": ["--host", "0.0.0.0"]}]},
     "profiles.0.args is ['--host', '0.0.0.0']: engine flag --host is not allowed"),
]


@pytest.mark.parametrize("change, said", REFUSALS)
def test_a_refused_catalog_model_is_explained_in_the_same_words(change: dict, said: str) -> None:
    from pydantic import ValidationError

    from llmgw.contract.catalog import CATALOG_MODEL
    from llmgw.contract.explain import problems

    model = {"name": "m", "source": "http://x/m.gguf",
             "profiles": [{"name": "cpu", "engine": "llamacpp"}], **change}
    with pytest.raises(ValidationError) as refused:
        CATALOG_MODEL.validate_python(model)
    assert problems(refused.value).startswith(said)


def test_a_drift_report_is_checked_by_its_one_definition() -> None:
    """contract.records.DriftReport carries the limits the control plane holds a report
    to (the admin API's PUT and the agent API's alike); the control: a good one passes,
    with its left-out parts filled in."""
    from pydantic import ValidationError

    from llmgw.contract.explain import problems
    from llmgw.contract.records import DRIFT_REPORT

    good = DRIFT_REPORT.validate_python(
        {"checked": 1.0, "promises": 2, "failing": [{"promise": "p", "since": 0.5}]})
    assert good == {"checked": 1.0, "promises": 2,
                    "failing": [{"promise": "p", "since": 0.5, "message": ""}]}
    with pytest.raises(ValidationError) as refused:
        DRIFT_REPORT.validate_python({"checked": 1.0, "promises": -1,
                                      "failing": [{"promise": "p" * 201, "since": 0}]})
    assert problems(refused.value) == (
        "promises is -1: Input should be greater than or equal to 0; failing.0.promise is "
        f"{'p' * 201!r}: String should have at most 200 characters")
