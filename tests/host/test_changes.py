"""llmgw.host.changes, the one set of change types: the service managers plan with it and the
harness's fixes yield it, so --plan renders both alike."""

from __future__ import annotations

import re
from pathlib import Path

from llmgw.host import changes, services
from llmgw.host.changes import Mkdir, Run, WriteFile
from llmgw_harness import _changes

SRC = Path(__file__).resolve().parents[2] / "src"
# Every name a change type has had: the one set's and the service managers' old ones.
CHANGE_NAMES = ("WriteFile", "Mkdir", "Run", "Chmod", "Chown", "Rename", "SystemUser",
                "WriteText", "MakeDir", "Command")


def _defined(names: tuple[str, ...]) -> dict[str, list[str]]:
    """Where under src/ a class of each name is defined."""
    found: dict[str, list[str]] = {}
    pattern = re.compile(rf"^class ({'|'.join(names)})\b", re.MULTILINE)
    for path in sorted(SRC.rglob("*.py")):
        for name in pattern.findall(path.read_text()):
            found.setdefault(name, []).append(str(path.relative_to(SRC)))
    return found


def test_each_change_type_is_defined_once_in_llmgw_changes() -> None:
    """No second set (services' WriteText/MakeDir/Command are gone); the scan's own control:
    it finds the one set where it is."""
    one_set = {name: ["llmgw/host/changes.py"] for name in CHANGE_NAMES[:7]}
    one_set["Run"].append("llmgw_harness/_run.py")  # a provision run: no change type
    assert _defined(CHANGE_NAMES) == one_set


def test_the_harness_and_the_service_managers_use_the_one_set() -> None:
    for name in ("WriteFile", "Mkdir", "Run", "Chmod", "Chown", "Rename", "SystemUser"):
        assert getattr(_changes, name) is getattr(changes, name)
    assert set(services.Action.__args__) == {WriteFile, Mkdir, Run}


def test_a_managers_change_renders_as_a_fixs_does(tmp_path: Path) -> None:
    """A unit replaced with its old text kept: the lines --plan shows for a manager's
    change are the change's own (and a command is the argv a person would type)."""
    unit = tmp_path / "llmgw-x.service"
    unit.write_text("[Unit]\nDescription=old\n")
    write = WriteFile(unit, "[Unit]\nDescription=new\n", backup=tmp_path / "llmgw-x.service.bak")
    shown = _changes._actions(None, [write, Run(("systemctl", "daemon-reload"))])  # type: ignore[arg-type]
    assert shown[0] == f"keep the old {unit} as {unit}.bak"
    assert "-Description=old" in shown and "+Description=new" in shown
    assert shown[-1] == "systemctl daemon-reload"
    write.apply()
    assert (tmp_path / "llmgw-x.service.bak").read_text() == "[Unit]\nDescription=old\n"
    assert _changes._actions(None, [write]) == []  # type: ignore[arg-type]
