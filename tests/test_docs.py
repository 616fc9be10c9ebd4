"""The docs live in the repository and say what the code does: the README stays short and
links nowhere outside, and docs/architecture.md's ports, API paths and unit directives are
the code's."""

from __future__ import annotations

import re
from pathlib import Path

from llmgw.config import ServerConfig, parse_listen
from llmgw.contract import AdminPaths, AgentPaths
from llmgw.control.admin_api import make_admin_app
from llmgw.store import Store
from llmgw_harness.settings import Listen

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
DOCS = [README, ARCHITECTURE, ROOT / "docs" / "operations.md", ROOT / "bench" / "README.md"]


def links(path: Path) -> list[str]:
    """The targets of the markdown links in path, without their #anchor."""
    return [t.partition("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", path.read_text())]


def outside_links(path: Path, root: Path = ROOT) -> list[str]:
    """Links of path that leave root or name a file it does not have."""
    bad = []
    for target in links(path):
        if not target or re.match(r"[a-z]+://", target):
            continue
        resolved = (path.parent / target).resolve()
        if root not in resolved.parents or not resolved.exists():
            bad.append(target)
    return bad


def test_the_readme_is_short_and_every_doc_links_only_inside_the_repository() -> None:
    assert len(README.read_text().splitlines()) < 200
    for doc in DOCS:
        assert outside_links(doc) == [], doc
        assert "shared/DESIGN.md" not in doc.read_text(), doc


def test_a_link_out_of_the_repository_is_caught(tmp_path: Path) -> None:
    """Negative control for the link check."""
    (tmp_path / "repo" / "docs").mkdir(parents=True)
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "DESIGN.md").write_text("")
    probe = tmp_path / "repo" / "docs" / "x.md"
    probe.write_text("[design](../../shared/DESIGN.md) [here](x.md) [gone](y.md)")
    assert outside_links(probe, tmp_path / "repo") == ["../../shared/DESIGN.md", "y.md"]


def process_table_ports(text: str) -> set[int]:
    table = text.split("## Processes, ports and files", 1)[1].split("\n\n", 2)[1]
    return {int(p) for p in re.findall(r"`[\d.]*:(\d+)`", table)}


def test_the_process_table_names_the_default_ports() -> None:
    server, listen = ServerConfig(), Listen()
    ports = {parse_listen(a)[1] for a in (server.admin_listen, server.agent_listen,
                                           server.gateway_listen, server.gateway_metrics_listen,
                                           listen.mirror, listen.mirror_api, listen.check)}
    assert process_table_ports(ARCHITECTURE.read_text()) == ports


def documented_paths(text: str) -> set[str]:
    """/api/v1 paths the text names, placeholders ({id}, HOST, ID) made `{}`."""
    found = set()
    segment = r"(?:[A-Za-z0-9_]|\{[^}]*\})"
    for path in re.findall(rf"/api/v1/(?:[A-Za-z0-9_/.-]|\{{[^}}]*\}})*{segment}", text):
        found.add(re.sub(r"\{[^}]*\}|\b[A-Z]+\b", "{}", path))
    return found


def served_paths(tmp_path: Path) -> set[str]:
    admin = make_admin_app(Store(tmp_path / "c.db"), node_timeout_s=30.0, token_hash=None)
    routes = {r.path for r in admin.routes}
    routes |= {v for k, v in vars(AgentPaths).items() if k.isupper()}
    routes |= mirror_paths()
    return {re.sub(r"\{[^}]*\}", "{}", r) for r in routes if r.startswith("/api/v1/")}


def mirror_paths() -> set[str]:
    """The mirror management API's paths, read from its routes' decorators."""
    source = (ROOT / "src" / "llmgw" / "mirror" / "_api.py").read_text()
    return set(re.findall(r'@app\.\w+\("(/api/v1/[^"]*)"', source))


def test_every_api_path_the_docs_name_is_served(tmp_path: Path) -> None:
    served = served_paths(tmp_path)
    for doc in DOCS[1:3]:
        named = documented_paths(doc.read_text())
        assert named, doc
        assert named <= served, f"{doc.name} names paths no API serves: {named - served}"


def test_the_path_check_catches_a_path_no_api_serves(tmp_path: Path) -> None:
    """Negative control."""
    assert documented_paths("`GET /api/v1/widgets/{id}`") - served_paths(tmp_path) == {
        "/api/v1/widgets/{}"}
    assert AdminPaths.drift("h").startswith("/api/v1/drift/")


def unit_directives(text: str) -> set[str]:
    section = text.split("## The systemd units", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"`([A-Z][A-Za-z]+=[^`\s]*)`", section))


def test_the_unit_directives_the_docs_name_are_in_the_shipped_units() -> None:
    shipped = {line.strip() for unit in (ROOT / "deploy" / "systemd").iterdir()
               for line in unit.read_text().splitlines()}
    named = unit_directives(ARCHITECTURE.read_text())
    assert len(named) >= 10
    assert named <= shipped, f"not in deploy/systemd: {named - shipped}"
    assert "KillMode=none" not in shipped  # the control below would pass vacuously otherwise
    assert {"KillMode=none"} - shipped == {"KillMode=none"}
