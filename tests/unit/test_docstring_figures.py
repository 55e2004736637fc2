"""Docstrings in framework/ state contracts, not measurements; cited benchmark notes exist.

A figure measured once ("17-20 µs against 2.6", "a quarter of the worker's CPU") goes
stale in a docstring where nobody re-measures it: it belongs in benchmarks/ (or in
the explanation pages under docs/explanation/), with its command and machine, and the docstring cites the heading
(CONTRIBUTING.md, "Changes"). A docstring may still state a contract value, a default or
a limit ("headers of at most 16 KiB"): those few are listed in :data:`ALLOWED`, each with
why. Inline code (a duration such as 10s in backticks) is a value a user writes, not a
figure, and is not judged. Attribute docstrings (a string after an assignment) count.

The citations ``benchmarks/<note>.md, "Heading"`` in the code must name a heading of that
note: the heading itself, or the start of exactly one heading followed by ``:`` or ``,``
(``"2026-11-24, morning"`` for ``"2026-11-24, morning: claims and marks …"``).
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FRAMEWORK = ROOT / "framework"

# A number (or a range of two), then a unit of time, size, share, rate or ratio. Bounded:
# no repetition inside a repetition, at most 20 characters per number.
_NUMBER = r"(?<![\w.])~?\d[\d,.]{0,20}(?:\s?[-\u2013]\s?\d[\d,.]{0,20})?"
_UNIT = (
    r"(?:[µu]s|ns|ms|s|sec|(?:micro|milli|nano)?seconds?|min|minutes?|h|hours?|[KMG]i?B|kB|bytes|msg/s|cores?)"
    r"(?![\w/])"
)
_WORDS = r"(?:two|three|four|five|six|seven|eight|nine|ten|a few|several|hundreds of|thousands of)"
_FIGURE = re.compile(
    rf"{_NUMBER}\s?(?:{_UNIT}|%)"
    r"|(?<![\w.])\d(?:[\d,.]{0,20}\d)?\s?(?:\u00d7|x(?!\w))"  # a ratio, not a version ("3.x")
    rf"|\b{_WORDS} (?:micro|milli|nano)?seconds\b|\b(?:about|some|under|over) a (?:micro|milli|nano)second\b"
    rf"|(?<!\w)(?:\d{{1,6}}|{_WORDS}) times (?:faster|slower|cheaper|dearer|more|less|fewer|as)\b"
    r"|\b(?:twice|half|a third|a quarter) as (?:much|many|fast|long|slow)\b"
    r"|\b(?:a third|a quarter|half) of (?:the|a|its) [\w' -]{0,40}?(?:time|CPU|run|work)\b",
    re.IGNORECASE,
)
_INLINE_CODE = re.compile(r"``[^`\n]{0,200}``|`[^`\n]{0,200}`")

# Docstrings that state contract values (a default, a limit, a bar) in units, by owner
# ("module" or "module:Qualified.name"). Each entry must still match: a stale one fails.
ALLOWED: dict[str, str] = {
    "framework.analytics.stats": "percentile_approx's accuracy, stated as the rank error it allows",
    "framework.dashboard.server": "the server's limits: header size and keep-alive",
    "framework.db:widen_statement_cache": "psycopg's cache limits and the ones txbox sets",
    "framework.db:Statistics.slow": "the bar a claim's time is judged by",
    "framework.confirms.channel:coalesce_writes": "the size of the chunks frames are joined into",
    "framework.sql.dead_letters:open_summary": "the window the count covers",
    "framework.sql.messages:health": "the windows the counts cover",
}

# Files being rewritten in the one-loop change, which moves their figures out: not judged
# until it lands (remove them from here then).
REWRITTEN: set[str] = set()


def figures(text: str) -> list[str]:
    """The measurements ``text`` states, inline code left out."""
    return [m.group(0) for m in _FIGURE.finditer(_INLINE_CODE.sub("", text))]


def docstrings(source: str, module: str) -> list[tuple[str, str]]:
    """(owner, docstring) of a module's source: the module, its classes and functions."""
    tree = ast.parse(source)
    found: list[tuple[str, str]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        body = getattr(node, "body", [])
        for before, child in zip([None, *body], body, strict=False):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                doc = ast.get_docstring(child, clean=False)
                if doc:
                    found.append((f"{module}:{name}", doc))
                visit(child, f"{name}.")
            elif _is_string(child) and isinstance(before, ast.Assign | ast.AnnAssign):
                targets = before.targets if isinstance(before, ast.Assign) else [before.target]
                names = [ast.unparse(target) for target in targets]
                found.append((f"{module}:{prefix}{'='.join(names)}", child.value.value))  # type: ignore[attr-defined]

    doc = ast.get_docstring(tree, clean=False)
    if doc:
        found.append((module, doc))
    visit(tree, "")
    return found


def _is_string(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def python_files(folder: Path, suffixes: tuple[str, ...] = (".py",)) -> list[Path]:
    files: list[Path] = []
    for path, subfolders, names in os.walk(folder):
        subfolders[:] = sorted(d for d in subfolders if d not in ("__pycache__", "node_modules"))
        files += [Path(path, n) for n in sorted(names) if n.endswith(suffixes)]
    return files


def framework_docstrings() -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    for path in python_files(FRAMEWORK):
        relative = path.relative_to(ROOT).as_posix()
        if relative in REWRITTEN:
            continue
        module = relative.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        found += docstrings(path.read_text(encoding="utf-8"), module)
    return found


def test_no_docstring_in_the_framework_states_a_measurement() -> None:
    offending = [
        f"{owner}: {', '.join(map(repr, hits))}"
        for owner, doc in framework_docstrings()
        if owner not in ALLOWED and (hits := figures(doc))
    ]
    assert not offending, (
        "figures in docstrings (move them to benchmarks/ or an explanation page and cite the heading):\n"
        + "\n".join(offending)
    )


def test_every_allowed_docstring_still_states_a_value() -> None:
    found = {owner: doc for owner, doc in framework_docstrings()}
    stale = [owner for owner in ALLOWED if owner not in found or not figures(found[owner])]
    assert not stale, f"entries of ALLOWED that no longer need to be there: {stale}"


def test_the_rewritten_files_exist() -> None:
    assert all((ROOT / path).is_file() for path in REWRITTEN), "a file of REWRITTEN is gone: drop it from the set"


@pytest.mark.parametrize(
    "text",
    [
        "cost 17-20 µs against 2.6",
        "came back 3 to 6 s after the server did",
        "about 7 % of the worker's time",
        "orjson does both 3-5x faster",
        "2.4\u00d7 the CPU per statement",
        "(~100 ms at 100k letters)",
        "a claim of 620 ms for 200 rows",
        "~1,700 msg/s here",
        "ten times faster than the pure-Python class",
        "spends about half as much per row",
        "a quarter of the worker's CPU",
        "costs a few microseconds per send",
        "the JVM's start (about 10 seconds)",
        "the JVM's start (about ten seconds)",
        "a regex scan cost twice as much as orjson's whole parse",
        "the no-op span cost a third of a small handler's run",
        "the SDK checks each one, about a microsecond each",
    ],
)
def test_a_measurement_is_found(text: str) -> None:
    assert figures(f'def f() -> None:\n    """Does it.\n\n    {text}.\n    """\n')


@pytest.mark.parametrize(
    "text",
    [
        "at most :data:`YOUNG_THRESHOLD` objects",
        "durations like ``10s`` or ``5m``",
        "`250ms`, `10s`, `5m`",
        "four times the limit",
        "a row delivered ``INBOX_DELIVERY_LIMIT`` times",
        "one statement instead of two",
        "sets the lease in the same statement as the claim",
        "RFC 3339 timestamps",
        "as SQLAlchemy does for psycopg2",
        "pika 2.x, RabbitMQ 3.x",
        "ISO 8601 in UTC with milliseconds",
        "a publish takes milliseconds",
    ],
)
def test_a_contract_is_not_a_measurement(text: str) -> None:
    assert not figures(text)


def test_a_planted_measurement_fails_the_scan() -> None:
    source = '"""A module."""\n\n\ndef claim() -> None:\n    """Claims rows (3-8 ms per claim at 500 msg/s)."""\n'
    assert [owner for owner, doc in docstrings(source, "planted") if figures(doc)] == ["planted:claim"]


# Citations of a benchmarks note: the note's path, then the heading in double quotes, which
# may continue on the next line of a comment or docstring.
_CITATION = re.compile(r'benchmarks/([\w./-]{1,80}\.md),?\s+"([^"]{1,300})"')
_CONTINUATION = re.compile(r"\n[ \t]*(?:#[ \t]*)?")
SEARCHED = (
    "framework", "tools", "tests", "migrations", "examples", "scripts", "docs", "benchmarks",
    "README.md", "RELIABILITY.md", "CONTRIBUTING.md",
)  # fmt: skip


def citing_files() -> list[Path]:
    this = Path(__file__).resolve()
    files: list[Path] = []
    for entry in SEARCHED:
        path = ROOT / entry
        files += [path] if path.is_file() else python_files(path, (".py", ".md", ".sh"))
    return [f for f in files if f.resolve() != this]


def benchmark_citations(text: str) -> list[tuple[str, str]]:
    flat = _CONTINUATION.sub(" ", text)
    return [(note, " ".join(name.split()).rstrip(".,")) for note, name in _CITATION.findall(flat)]


def headings(note: Path) -> list[str]:
    lines = note.read_text(encoding="utf-8").splitlines()
    return [line.lstrip("#").strip() for line in lines if re.match(r"#{1,6} ", line)]


def cites_one_heading(name: str, titles: list[str]) -> bool:
    if name in titles:
        return True
    return sum(1 for title in titles if title.startswith((f"{name}:", f"{name},"))) == 1


def test_every_cited_benchmark_heading_exists() -> None:
    missing = []
    for path in citing_files():
        for note, name in benchmark_citations(path.read_text(encoding="utf-8", errors="replace")):
            file = ROOT / "benchmarks" / note
            if not file.is_file() or not cites_one_heading(name, headings(file)):
                missing.append(f"{path.relative_to(ROOT)}: benchmarks/{note}, {name!r}")
    assert not missing, "citations of benchmarks/ naming no heading (or more than one):\n" + "\n".join(missing)


def test_the_benchmark_citations_are_found() -> None:
    found = {
        citation
        for path in python_files(FRAMEWORK)
        for citation in benchmark_citations(path.read_text(encoding="utf-8"))
    }
    assert ("code-choices.md", "JSON on the hot paths") in found
    assert ("README.md", "2026-11-24, morning") in found


def test_a_prefix_names_one_heading() -> None:
    titles = ["2026-11-24, morning: claims", "2026-11-24: fewer claims", "The relay's column names, and levers"]
    assert cites_one_heading("2026-11-24, morning", titles)
    assert cites_one_heading("The relay's column names", titles)
    assert not cites_one_heading("2026-11-24", titles)  # two headings begin so
    assert not cites_one_heading("2026-11", titles)
