"""Each module of framework.sql goes by one name wherever framework/ and tools/ import it.

The name is the module's own with ``_sql`` after it (``from framework.sql import outbox
as outbox_sql``): a reader meets ``outbox_sql.claim`` in the relay and in the benchmarks
alike, never ``named.claim`` in one file and ``q.claim`` in another.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SQL_MODULES = {p.stem for p in (ROOT / "framework" / "sql").glob("*.py") if p.stem != "__init__"}


def sql_module_names(tree: ast.AST) -> list[tuple[str, str, int]]:
    """(module, the name it is bound to, line) for every import of a framework.sql module in ``tree``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "framework.sql" and node.level == 0:
            found += [(a.name, a.asname or a.name, node.lineno) for a in node.names if a.name in SQL_MODULES]
        elif isinstance(node, ast.Import):
            for a in node.names:
                module = a.name.removeprefix("framework.sql.")
                if module != a.name and module in SQL_MODULES:
                    found.append((module, a.asname or a.name, node.lineno))
    return found


def test_the_scan_sees_every_form_of_import() -> None:
    tree = ast.parse(
        "from framework.sql import outbox as q, rendered\n"
        "def f():\n    from framework.sql import inbox\n"
        "import framework.sql.heartbeats as beats\n"
    )
    assert sorted(sql_module_names(tree), key=lambda found: found[2]) == [
        ("outbox", "q", 1),
        ("inbox", "inbox", 3),
        ("heartbeats", "beats", 4),
    ]


def test_every_framework_sql_module_has_one_name() -> None:
    names: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for top in ("framework", "tools"):
        for path in sorted((ROOT / top).rglob("*.py")):
            for module, name, line in sql_module_names(ast.parse(path.read_text(), str(path))):
                names[module][name].append(f"{path.relative_to(ROOT)}:{line}")
    assert names, "no import of a framework.sql module found: the scan is broken"
    wrong = {
        module: {name: where for name, where in by_name.items() if name != f"{module}_sql"}
        for module, by_name in names.items()
    }
    wrong = {module: by_name for module, by_name in wrong.items() if by_name}
    assert not wrong, "import framework.sql modules as <module>_sql:\n" + "\n".join(
        f"  {module} as {name}: {', '.join(where)}"
        for module, by_name in wrong.items()
        for name, where in by_name.items()
    )
