"""The packages' import graph, read from the source with ``ast`` (nothing is imported).

* Direction: each package imports only the packages below it (``ALLOWED``): ``common`` nothing;
  ``transferqueue`` and ``checkpointengine`` only ``common``; ``rollers`` and ``trainers`` those and never
  each other; ``controller`` anything. Every ``import`` counts, also those inside functions.
* No cycles among modules through imports that run at import time (module level, outside
  ``if TYPE_CHECKING:``); imports inside functions run later and cannot deadlock an import. Edges are
  read per module, so a cycle between packages shows up as a cycle between their modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

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


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module, module: str, is_package: bool) -> list[tuple[str, bool]]:
    """(imported module, at import time?) for every import statement of a module."""
    out: list[tuple[str, bool]] = []

    def targets(node) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        base = node.module or ""
        if node.level:  # relative: resolve against this module's package
            pkg = module.split(".") if is_package else module.split(".")[:-1]
            pkg = pkg[: len(pkg) - (node.level - 1)]
            base = ".".join(pkg + ([base] if base else []))
        # ``from pkg import mod`` imports pkg.mod when that is a module; keep both candidates
        return [base] + [f"{base}.{a.name}" for a in node.names]

    def walk(nodes, eager: bool) -> None:
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                out.extend((t, eager) for t in targets(node))
            elif isinstance(node, ast.If) and _is_type_checking(node):
                walk(node.body, False)
                walk(node.orelse, eager)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                walk(ast.iter_child_nodes(node), False)
            else:
                walk(ast.iter_child_nodes(node), eager)

    walk(tree.body, True)
    return out


def import_graph(root: Path = ROOT) -> tuple[set[str], dict[str, list[tuple[str, bool]]]]:
    """Modules of ``PACKAGES`` under ``root`` and each one's imports of modules among them."""
    files = {_module_name(p, root): p for pkg in PACKAGES for p in (root / pkg).rglob("*.py")}
    modules = set(files)
    graph = {}
    for name, path in files.items():
        found = _imports(ast.parse(path.read_text(), str(path)), name, path.name == "__init__.py")
        graph[name] = [(t, eager) for t, eager in found if t in modules and t != name]
    return modules, graph


def wrong_direction(graph) -> list[str]:
    bad = []
    for module, imports in graph.items():
        src = module.split(".")[0]
        for target, _ in imports:
            dst = target.split(".")[0]
            if dst != src and dst not in ALLOWED[src]:
                bad.append(f"{module} imports {target} ({src} may import only {sorted(ALLOWED[src])})")
    return sorted(set(bad))


def eager_cycles(graph) -> list[list[str]]:
    """Cycles through import-time edges. An import of one's own ancestor package (``from pkg import
    mod`` inside ``pkg``) is no edge: Python imports every ancestor before the module itself."""
    edges: dict[str, set[str]] = {m: set() for m in graph}
    for module, imports in graph.items():
        for target, eager in imports:
            if eager and not module.startswith(target + "."):
                edges[module].add(target)
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [])
    return cycles


def test_packages_import_only_downward():
    _, graph = import_graph()
    assert wrong_direction(graph) == []


def test_no_import_time_cycles():
    _, graph = import_graph()
    assert eager_cycles(graph) == []


def test_checker_catches_a_wrong_direction_import_and_a_cycle(tmp_path):
    """The checks can fail: a checkpointengine module importing rollers, and a two-module cycle."""
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "rollers" / "engine.py").write_text("class EngineError(RuntimeError): ...\n")
    (tmp_path / "checkpointengine" / "receiver.py").write_text(
        "def f():\n    from rollers.engine import EngineError\n")
    (tmp_path / "trainers" / "a.py").write_text("from trainers import b\n")
    (tmp_path / "trainers" / "b.py").write_text("from typing import TYPE_CHECKING\nimport trainers.a\n"
                                                "if TYPE_CHECKING:\n    from trainers import c\n")
    (tmp_path / "trainers" / "c.py").write_text("from . import b\n")
    _, graph = import_graph(tmp_path)
    assert wrong_direction(graph) == [
        "checkpointengine.receiver imports rollers.engine (checkpointengine may import only ['common'])"]
    assert sorted(map(tuple, eager_cycles(graph))) in ([("trainers.a", "trainers.b", "trainers.a")],
                                                       [("trainers.b", "trainers.a", "trainers.b")])
