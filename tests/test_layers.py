"""The layers of src/llmgw, held by its import graph (docs/architecture.md, "Layout").

One package per process (agent, mirror, gateway, control), the layers they share below them
(http1, contract, model, host, store and the top-level errors, config, httpclient), and the
command (cli) and the harness (llmgw_harness) on top. The graph is read from the source's
AST: every `import` and `from ... import`, in a function too; an import under
`if TYPE_CHECKING:` is for the type checker alone and is left out. Three rules:

- a process package imports no other process's package (the gateway and the control plane
  share the store and the contract, never each other);
- a shared layer imports no process package, nor the command, nor the harness;
- no import cycle at run time, among modules.

Each rule has its negative control below: a small tree with the forbidden import, and the
checker naming both modules, the rule and what to do.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"

# Under llmgw: each top-level package or module, by what it is.
PROCESSES = ("agent", "mirror", "gateway", "control")
SHARED = ("http1", "contract", "model", "host", "store", "errors", "config", "httpclient")
TOP = ("cli", "__main__", "__init__")
# The top of src/llmgw holds packages, and these modules alone (each says in Layout why).
TOP_MODULES = {"__init__", "__main__", "errors", "config", "httpclient"}


@dataclass(frozen=True)
class Import:
    importer: str  # module
    imported: str  # module
    line: int


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_only(tree: ast.AST) -> set[int]:
    """The ids of nodes under `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                skip.update(id(n) for n in ast.walk(inner))
    return skip


def imports(root: Path) -> Iterator[Import]:
    """Every run-time import from one of root's modules of another of them, as modules: a
    name imported from a package is the submodule of that name when there is one."""
    paths = sorted(root.rglob("*.py"))
    modules = {module_name(p, root) for p in paths}
    for path in paths:
        me = module_name(path, root)
        package = me if path.name == "__init__.py" else me.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_only(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules:
                        yield Import(me, alias.name, node.lineno)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - (node.level - 1)]
                    of = ".".join(base + ([node.module] if node.module else []))
                else:
                    of = node.module or ""
                for alias in node.names:
                    sub = f"{of}.{alias.name}"
                    if sub in modules:
                        yield Import(me, sub, node.lineno)
                    elif of in modules:
                        yield Import(me, of, node.lineno)


def part(module: str) -> str:
    """The layer a module of llmgw belongs to: its top-level package or module under llmgw;
    the harness is one part of its own."""
    top, _, rest = module.partition(".")
    if top != "llmgw":
        return top
    return rest.partition(".")[0] or "__init__"


def broken_layers(root: Path) -> list[str]:
    """What breaks the layering rules, one line each, naming both modules and what to do."""
    found: list[str] = []
    for imp in imports(root):
        a, b = part(imp.importer), part(imp.imported)
        if a == b:
            continue
        where = f"{imp.importer} (line {imp.line}) imports {imp.imported}"
        if a in PROCESSES and b in PROCESSES:
            found.append(
                f"{where}: a process package imports no other process's package ({a} and {b}"
                f" are processes of their own). Move what both need into a shared layer"
                f" ({', '.join(SHARED)}), or into {a}.")
        elif a in SHARED and b not in SHARED:
            found.append(
                f"{where}: a shared layer ({a}) imports no process package, nor the command"
                f" nor the harness ({b}). Move what {a} needs from {b} down into {a} (or"
                f" another shared layer), and let {b} import it from there.")
        elif a not in PROCESSES + SHARED + TOP and a != "llmgw_harness":
            found.append(f"{imp.importer} is in no layer: name {a} in tests/test_layers.py's"
                         f" PROCESSES, SHARED or TOP, and in docs/architecture.md's Layout.")
    return sorted(set(found))


def cycles(root: Path) -> list[str]:
    """Import cycles at run time among root's modules, one line each (Tarjan's strongly
    connected components; each printed as one path around it)."""
    graph: dict[str, set[str]] = {}
    for imp in imports(root):
        if imp.importer != imp.imported:
            graph.setdefault(imp.importer, set()).add(imp.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    found = []
    for component in components:
        inside = set(component)
        path = [component[0]]
        while True:  # walk inside the component until a module comes round again
            nxt = sorted(graph[path[-1]] & inside)[0]
            if nxt in path:
                path = path[path.index(nxt):] + [nxt]
                break
            path.append(nxt)
        found.append(
            f"import cycle at run time: {' -> '.join(path)}. Break it: move the name both"
            f" need into the lower module, or import it under `if TYPE_CHECKING:` where it"
            f" is only a type.")
    return found


def test_the_process_packages_and_the_shared_layers_keep_to_their_layers() -> None:
    assert broken_layers(SRC) == []


def test_no_import_cycle_at_run_time() -> None:
    assert cycles(SRC) == []


def test_the_top_of_the_package_holds_packages_and_few_modules() -> None:
    modules = {p.stem for p in (SRC / "llmgw").glob("*.py")}
    assert modules == TOP_MODULES, (
        "a module at src/llmgw's top level belongs in a package (docs/architecture.md, Layout)")
    assert len(TOP_MODULES - {"__init__", "__main__", "errors"}) <= 3


def test_every_part_of_llmgw_is_in_a_layer() -> None:
    parts = {p.name for p in (SRC / "llmgw").iterdir() if (p / "__init__.py").is_file()}
    parts |= {p.stem for p in (SRC / "llmgw").glob("*.py")}
    assert parts == set(PROCESSES + SHARED + TOP)


# Negative controls: a small tree of the same shape, with one forbidden import each.

def tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in path.relative_to(root).parents:
            if str(parent) != ".":
                (root / parent / "__init__.py").touch()
        path.write_text(text)
    return root


def test_the_gateway_importing_the_control_plane_is_caught(tmp_path: Path) -> None:
    root = tree(tmp_path, {
        "llmgw/control/metrics.py": "",
        "llmgw/gateway/app.py": "def f():\n    from llmgw.control import metrics\n"})
    [line] = broken_layers(root)
    assert line.startswith("llmgw.gateway.app (line 2) imports llmgw.control.metrics: a process"
                           " package imports no other process's package")
    assert "Move what both need into a shared layer" in line


@pytest.mark.parametrize("importer,imported", [
    ("agent", "control"), ("mirror", "control"), ("control", "gateway"), ("agent", "gateway")])
def test_each_process_importing_another_is_caught(tmp_path: Path, importer: str,
                                                 imported: str) -> None:
    root = tree(tmp_path, {f"llmgw/{imported}/x.py": "",
                           f"llmgw/{importer}/y.py": f"from llmgw.{imported}.x import X\n"})
    [line] = broken_layers(root)
    assert f"llmgw.{importer}.y (line 1) imports llmgw.{imported}.x" in line


def test_a_shared_layer_importing_a_process_is_caught(tmp_path: Path) -> None:
    root = tree(tmp_path, {
        "llmgw/gateway/_upstream.py": "LIMIT = 64\n",
        "llmgw/model/engine_args.py": "from llmgw.gateway._upstream import LIMIT\n",
        "llmgw/store/__init__.py": "import llmgw.cli\n",
        "llmgw/cli/__init__.py": ""})
    found = broken_layers(root)
    assert len(found) == 2
    assert found[0].startswith("llmgw.model.engine_args (line 1) imports llmgw.gateway._upstream:"
                               " a shared layer (model) imports no process package")
    assert "Move what model needs from gateway down into model" in found[0]
    assert found[1].startswith("llmgw.store (line 1) imports llmgw.cli: a shared layer (store)")


def test_a_type_only_import_is_no_layer_break_but_a_late_import_is(tmp_path: Path) -> None:
    root = tree(tmp_path, {
        "llmgw/control/nodes.py": "class Hearing: ...\n",
        "llmgw/store/__init__.py": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from llmgw.control.nodes import Hearing\n")})
    assert broken_layers(root) == []
    (root / "llmgw/store/__init__.py").write_text(
        "def hearing():\n    from llmgw.control.nodes import Hearing\n    return Hearing\n")
    [line] = broken_layers(root)
    assert line.startswith("llmgw.store (line 2) imports llmgw.control.nodes: a shared layer")


def test_an_unknown_part_is_caught(tmp_path: Path) -> None:
    root = tree(tmp_path, {"llmgw/errors.py": "", "llmgw/newthing/x.py": "import llmgw.errors\n"})
    [line] = broken_layers(root)
    assert line.startswith("llmgw.newthing.x is in no layer: name newthing")


def test_an_import_cycle_is_caught_naming_its_modules(tmp_path: Path) -> None:
    root = tree(tmp_path, {
        "llmgw/http1/server.py": "from llmgw.http1._conn import Connection\n",
        "llmgw/http1/_conn.py": "from llmgw.http1._cycle import Cycle\n",
        "llmgw/http1/_cycle.py": "from . import server\n"})
    [line] = cycles(root)
    assert line.startswith("import cycle at run time: llmgw.http1._conn -> llmgw.http1._cycle"
                           " -> llmgw.http1.server -> llmgw.http1._conn. Break it:")
    # under TYPE_CHECKING, the same import is no cycle
    (root / "llmgw/http1/_cycle.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import server\n")
    assert cycles(root) == []
