"""The protocol package's modules import one another without a circle (a circle would force
function-local imports and make the import order matter)."""

from __future__ import annotations

import ast
from pathlib import Path

import kvbridge_agent.protocol as protocol

PACKAGE = Path(protocol.__file__).parent


def _graph() -> dict[str, set[str]]:
    """Module -> the sibling modules it imports (anywhere in the file, also inside functions
    and TYPE_CHECKING blocks)."""
    graph = {}
    for path in PACKAGE.glob("_*.py"):
        if path.stem == "__init__":
            continue
        graph[path.stem] = {node.module for node in ast.walk(ast.parse(path.read_text()))
                            if isinstance(node, ast.ImportFrom) and node.level == 1
                            and node.module}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node):], node]
        if node in done:
            return None
        for nxt in sorted(graph.get(node, ())):
            found = visit(nxt, [*path, node])
            if found:
                return found
        done.add(node)
        return None

    for start in sorted(graph):
        found = visit(start, [])
        if found:
            return found
    return None


def test_protocol_modules_import_without_a_circle():
    graph = _graph()
    assert {"_wire", "_compat", "_errors", "_verdict", "_validate", "_engine"} <= set(graph)
    assert _cycle(graph) is None, f"import circle: {' -> '.join(_cycle(graph) or [])}"


def test_the_cycle_check_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
