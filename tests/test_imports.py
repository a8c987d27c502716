"""The package's modules import each other without a cycle, counting imports inside functions: the
closed-form variances and estimators do not need the layer classes."""

import ast
from pathlib import Path

import sketchprop

PACKAGE = Path(sketchprop.__file__).parent


def internal_imports(path: Path) -> set[str]:
    """Names of the package's modules that ``path`` imports anywhere (top level or in a function)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                out.add(node.module.split(".")[0])
            else:  # from . import a, b
                out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sketchprop."):
            out.add(node.module.split(".")[1])
    return out


def import_graph() -> dict[str, set[str]]:
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    return {m: internal_imports(PACKAGE / f"{m}.py") & modules for m in modules}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle():
    graph = import_graph()
    assert graph["layers"] >= {"functional", "sketches"}  # the scan sees real imports
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_scan_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_estimators_do_not_need_the_layers():
    graph = import_graph()
    assert graph["variance"] == {"sketches", "quantize"}  # the closed forms of both kinds
    assert graph["sketches"] == set() and graph["quantize"] == set()
