"""No import cycle runs through framework/sql/: the SQL is below the modules that use it.

The graph is read from the source, not from ``sys.modules``: an import under ``if
TYPE_CHECKING:`` or inside a function is an edge too, since it ties the two modules
together all the same (mypy follows it, and so does a reader). The filters a statement
takes live beside it for this reason (docs/explanation/daemons.md, "Tables and their SQL").
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def module_sources(root: Path) -> dict[str, str]:
    """Every module of the ``framework`` package under ``root``, by dotted name, with its text."""
    found = {}
    for path in sorted((root / "framework").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path.read_text()
    return found


def import_graph(sources: Mapping[str, str]) -> dict[str, set[str]]:
    """For each module, the other modules of ``sources`` it imports anywhere in its text."""

    def known(name: str) -> str | None:
        # `from framework.sql import pending` names a module; `from framework.pending import
        # Filters` names a module's attribute: the longest known prefix is the module.
        while name and name not in sources:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {module: set() for module in sources}
    for module, text in sources.items():
        for node in ast.walk(ast.parse(text, module)):
            if isinstance(node, ast.Import):
                targets = [known(a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0 and node.module, f"{module}: a relative import, which this scan does not follow"
                targets = [known(f"{node.module}.{a.name}") for a in node.names]
            else:
                continue
            graph[module].update(t for t in targets if t is not None and t != module)
    return graph


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, each sorted (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_scan_sees_imports_for_types_and_in_functions() -> None:
    sources = {
        "framework.sql": "",
        "framework.sql.pending": "if TYPE_CHECKING:\n    from framework.pending import Filters\n",
        "framework.pending": "from framework.sql import pending as pending_sql\n",
        "framework.a": "def f():\n    import framework.b\n",
        "framework.b": "from framework import a, names\n",
        "framework.c": "from framework.a import f\n",
    }
    assert cycles(import_graph(sources)) == [
        ["framework.a", "framework.b"],
        ["framework.pending", "framework.sql.pending"],
    ]


def test_no_import_cycle_runs_through_framework_sql() -> None:
    graph = import_graph(module_sources(ROOT))
    assert "framework.sql.dead_letters" in graph["framework.dashboard.app"], "the scan is broken"
    through_sql = [c for c in cycles(graph) if any(m == "framework.sql" or m.startswith("framework.sql.") for m in c)]
    assert not through_sql, (
        "framework/sql/ imports a module that imports it back: move what the SQL needs beside it\n"
        + "\n".join("  " + " <-> ".join(c) for c in through_sql)
    )
