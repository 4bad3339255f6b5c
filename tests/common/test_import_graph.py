"""The packages' import graph, read from the source with ``ast`` (nothing is imported).

* Direction: each package imports only the packages below it (``ALLOWED``): ``common`` nothing;
  ``transferqueue`` and ``checkpointengine`` only ``common``; ``rollers`` and ``trainers`` those and never
  each other; ``controller`` anything. Every ``import`` counts, also those inside functions.
* No cycles among modules through any import: at module level, inside a function, or under
  ``if TYPE_CHECKING:``. A function-level import only postpones a cycle (the two modules still need each
  other) and a ``TYPE_CHECKING`` one is a cycle a type checker walks; either way the seam is on the wrong
  side (STYLE.md 12). Edges are read per module, so a cycle between packages shows up as a cycle between
  their modules. Each cycle is reported as a chain of modules, every link with its file, line and level.
  An import of a module in a string (``importlib.import_module``: the registries' ``module:name`` plug-ins,
  ``checkpointengine.backend``'s discovery of ``checkpointengine/backends/``) is invisible here.

What one import statement adds as edges from module ``m``, after resolving relative imports:

* its target: ``import a.b.c`` -> ``a.b.c``; ``from a.b import c`` -> ``a.b.c`` when ``c`` is a module (Python
  imports that submodule; ``a.b``'s own names are not read), else ``a.b`` (``c`` is a name ``a/b/__init__.py``
  or ``a/b.py`` defines, so that module's body must have run);
* the packages on the way (``a`` and ``a.b`` for ``a.b.c``): their ``__init__`` runs first, so each is an edge,
  except an ancestor package of ``m`` itself: Python imports every ancestor before ``m``'s body starts, and
  naming a submodule through it reads none of its names. Hence a package ``__init__`` that re-exports its
  submodules (``from pkg.mod import X`` in ``pkg``) is a real edge ``pkg -> pkg.mod``, while
  ``from pkg import mod`` inside ``pkg.other`` is an edge to ``pkg.mod`` only (while ``pkg`` is still running,
  Python imports ``pkg.mod`` and takes it from ``sys.modules``; e.g. ``from transferqueue import wire`` in the
  modules that ``transferqueue/__init__.py`` re-exports); ``from pkg import X`` inside ``pkg.other``, ``X`` not
  a module, is an edge to ``pkg`` and closes a cycle with such a re-export (``X`` may not be defined yet).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("common", "transferqueue", "checkpointengine", "rollers", "trainers", "controller")
ALLOWED = {
    "common": set(),
    "transferqueue": {"common"},
    "checkpointengine": {"common"},
    "rollers": {"common", "checkpointengine", "transferqueue"},
    "trainers": {"common", "checkpointengine", "transferqueue"},
    "controller": set(PACKAGES),
}

MODULE_LEVEL, IN_FUNCTION, TYPE_CHECKING_ONLY = "module level", "in a function", "under TYPE_CHECKING"


@dataclass(frozen=True)
class Edge:
    """``source`` imports ``target`` at ``path:line``; ``level`` is when: ``MODULE_LEVEL`` (at import time),
    ``IN_FUNCTION`` or ``TYPE_CHECKING_ONLY``; ``on_the_way``: ``target`` is a package the statement runs
    on the way to the module it names."""

    source: str
    target: str
    path: str
    line: int
    level: str
    on_the_way: bool = False

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} ({self.path}:{self.line}, {self.level})"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: set[str]) -> list[str]:
    """The modules one import statement of ``module`` names (see the module docstring): for ``from base import
    x``, ``base.x`` where that is a module, else ``base``."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:  # relative: resolve against this module's package
        pkg = module.split(".") if is_package else module.split(".")[:-1]
        pkg = pkg[: len(pkg) - (node.level - 1)]
        base = ".".join(pkg + ([base] if base else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]


def _edge_targets(target: str, module: str) -> list[tuple[str, bool]]:
    """(module, on the way?): the packages the import of ``target`` runs on the way, less ``module``'s own
    ancestors, then ``target``."""
    parts = target.split(".")
    on_the_way = [".".join(parts[:i]) for i in range(1, len(parts))]
    return [(p, True) for p in on_the_way if not module.startswith(p + ".")] + [(target, False)]


def _imports(tree: ast.Module, module: str, is_package: bool, modules: set[str]
             ) -> list[tuple[str, int, str, bool]]:
    """(imported module, line, level, on the way?) for every import statement of ``module``."""
    out: list[tuple[str, int, str, bool]] = []

    def walk(nodes, level: str) -> None:
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(node, module, is_package, modules):
                    out.extend((t, node.lineno, level, via) for t, via in _edge_targets(target, module))
            elif isinstance(node, ast.If) and _is_type_checking(node):
                walk(node.body, TYPE_CHECKING_ONLY)
                walk(node.orelse, level)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                walk(ast.iter_child_nodes(node), TYPE_CHECKING_ONLY if level == TYPE_CHECKING_ONLY else IN_FUNCTION)
            else:
                walk(ast.iter_child_nodes(node), level)

    walk(tree.body, MODULE_LEVEL)
    return out


def import_graph(root: Path = ROOT) -> tuple[set[str], dict[str, list[Edge]]]:
    """Modules of ``PACKAGES`` under ``root`` and each one's imports of modules among them."""
    files = {_module_name(p, root): p for pkg in PACKAGES for p in (root / pkg).rglob("*.py")}
    modules = set(files)
    graph = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        found = _imports(tree, name, path.name == "__init__.py", modules)
        rel = str(path.relative_to(root))
        graph[name] = [Edge(name, t, rel, line, level, via) for t, line, level, via in found
                       if t in modules and t != name]
    return modules, graph


def wrong_direction(graph: dict[str, list[Edge]]) -> list[str]:
    bad = []
    for module, edges in graph.items():
        src = module.split(".")[0]
        for edge in edges:
            if edge.on_the_way:  # the module the statement names is in the same package
                continue
            dst = edge.target.split(".")[0]
            if dst != src and dst not in ALLOWED[src]:
                bad.append(f"{module} imports {edge.target} ({src} may import only {sorted(ALLOWED[src])})")
    return sorted(set(bad))


def cycles(graph: dict[str, list[Edge]], eager_only: bool = False) -> list[tuple[frozenset[str], list[Edge]]]:
    """The strongly connected components of more than one module (through module-level imports only with
    ``eager_only``), each with its shortest cycle through its first module (sorted by name) as a chain of
    edges; components sorted by their first module."""
    edges: dict[str, dict[str, Edge]] = {m: {} for m in graph}
    for module, found in graph.items():
        for edge in sorted(found, key=lambda e: (e.level != MODULE_LEVEL, e.line)):  # report the eager one
            if not eager_only or edge.level == MODULE_LEVEL:
                edges[module].setdefault(edge.target, edge)
    components = [c for c in _components(edges) if len(c) > 1]
    out = []
    for component in sorted(components, key=min):
        start = min(component)
        out.append((frozenset(component), _shortest_cycle(start, edges, component)))
    return out


def _components(edges: dict[str, dict[str, Edge]]) -> list[set[str]]:
    """Tarjan's strongly connected components of ``edges`` (Tarjan 1972)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, {})):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            found.append(component)

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def _shortest_cycle(start: str, edges: dict[str, dict[str, Edge]], component: set[str]) -> list[Edge]:
    """The shortest chain of edges from ``start`` back to ``start`` inside ``component`` (breadth first)."""
    came_by: dict[str, Edge] = {}
    frontier = [start]
    while frontier:
        nxt_frontier = []
        for node in frontier:
            for target, edge in sorted(edges[node].items()):
                if target == start:
                    chain = [edge]
                    while chain[0].source != start:
                        chain.insert(0, came_by[chain[0].source])
                    return chain
                if target in component and target not in came_by:
                    came_by[target] = edge
                    nxt_frontier.append(target)
        frontier = nxt_frontier
    raise AssertionError(f"{start} is in a component but on no cycle")


def describe(found: list[tuple[frozenset[str], list[Edge]]]) -> list[str]:
    """One readable paragraph per cycle: the chain of modules, each link's file and line, the component."""
    out = []
    for component, chain in found:
        modules = " -> ".join([chain[0].source] + [e.target for e in chain])
        links = "".join(f"\n    {e}" for e in chain)
        out.append(f"{modules}{links}\n  component ({len(component)} modules): {sorted(component)}")
    return out


def test_packages_import_only_downward():
    _, graph = import_graph()
    assert wrong_direction(graph) == []


def test_no_import_time_cycles():
    """Implied by the next test; kept for the message, which says the cycle would deadlock an import."""
    _, graph = import_graph()
    found = cycles(graph, eager_only=True)
    if found:
        pytest.fail("import cycles at import time:\n" + "\n".join(describe(found)), pytrace=False)


def test_no_cycles_at_any_level():
    _, graph = import_graph()
    found = cycles(graph)
    if found:
        pytest.fail("import cycles:\n" + "\n".join(describe(found)), pytrace=False)


def _tree(root: Path, files: dict[str, str]) -> None:
    for pkg in PACKAGES:
        (root / pkg).mkdir()
        (root / pkg / "__init__.py").write_text("")
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_checker_catches_a_wrong_direction_import_and_a_cycle(tmp_path):
    """The checks can fail: a checkpointengine module importing rollers, and a two-module cycle."""
    _tree(tmp_path, {
        "rollers/engine.py": "class EngineError(RuntimeError): ...\n",
        "checkpointengine/receiver.py": "def f():\n    from rollers.engine import EngineError\n",
        "trainers/a.py": "from trainers import b\n",
        "trainers/b.py": "from typing import TYPE_CHECKING\nimport trainers.a\nif TYPE_CHECKING:\n"
                         "    from trainers import c\n",
        "trainers/c.py": "from . import b\n",
    })
    _, graph = import_graph(tmp_path)
    assert wrong_direction(graph) == [
        "checkpointengine.receiver imports rollers.engine (checkpointengine may import only ['common'])"]
    eager = cycles(graph, eager_only=True)
    assert [(sorted(c), [(e.source, e.target) for e in chain]) for c, chain in eager] == [
        (["trainers.a", "trainers.b"], [("trainers.a", "trainers.b"), ("trainers.b", "trainers.a")])]


def test_checker_catches_function_level_and_type_checking_cycles(tmp_path):
    """Cycles closed by an import inside a function and by one under ``TYPE_CHECKING`` are caught and
    reported as chains with file, line and level; neither is an import-time cycle."""
    _tree(tmp_path, {
        "rollers/roller.py": "def make():\n    from rollers.agent_loop import AgentLoop\n",
        "rollers/agent_loop.py": "from rollers.roller import PromptGroup\n",
        "checkpointengine/backend.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                       "    from checkpointengine.config import Config\n",
        "checkpointengine/config.py": "from checkpointengine.backend import get_backend\n",
    })
    _, graph = import_graph(tmp_path)
    assert cycles(graph, eager_only=True) == []
    found = cycles(graph)
    assert [sorted(c) for c, _ in found] == [["checkpointengine.backend", "checkpointengine.config"],
                                             ["rollers.agent_loop", "rollers.roller"]]
    assert describe(found)[1].splitlines()[:3] == [
        "rollers.agent_loop -> rollers.roller -> rollers.agent_loop",
        "    rollers.agent_loop -> rollers.roller (rollers/agent_loop.py:1, module level)",
        "    rollers.roller -> rollers.agent_loop (rollers/roller.py:2, in a function)"]
    assert found[0][1][0].level == TYPE_CHECKING_ONLY


def test_edges_of_packages_and_their_submodules(tmp_path):
    """A package ``__init__`` that re-exports a submodule is an edge to it; ``from pkg import mod`` inside the
    package is an edge to ``pkg.mod`` only (no cycle with the re-export), ``from pkg import Name`` an edge to
    ``pkg`` (a cycle); importing ``a.b.c`` from outside ``a`` runs ``a`` and ``a.b`` too, from inside only what
    is named."""
    _tree(tmp_path, {
        "transferqueue/__init__.py": "from transferqueue.client import Client\n",
        "transferqueue/wire.py": "",
        "transferqueue/client.py": "from transferqueue import wire\nclass Client: ...\n",
        "trainers/__init__.py": "from trainers.loss import Loss\nTOLERANCE = 1e-6\n",
        "trainers/loss.py": "from trainers import TOLERANCE\nclass Loss: ...\n",
        "rollers/sub/__init__.py": "",
        "rollers/sub/shallow.py": "",
        "rollers/sub/deep.py": "from . import shallow\nfrom .. import sub\n",
        "rollers/user.py": "import rollers.sub.deep\n",
    })
    _, graph = import_graph(tmp_path)
    assert {str(e) for e in graph["transferqueue"]} == {
        "transferqueue -> transferqueue.client (transferqueue/__init__.py:1, module level)"}
    assert [e.target for e in graph["transferqueue.client"]] == ["transferqueue.wire"]
    assert [e.target for e in graph["rollers.user"]] == ["rollers.sub", "rollers.sub.deep"]
    # ``rollers`` and ``rollers.sub`` are its own packages: only what it names is an edge
    assert [e.target for e in graph["rollers.sub.deep"]] == ["rollers.sub.shallow", "rollers.sub"]
    assert [sorted(c) for c, _ in cycles(graph)] == [["trainers", "trainers.loss"]]
