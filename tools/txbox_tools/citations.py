"""Citations of the documentation's sections, checked, and moved when sections move.

Code comments, docstrings, the README and the pages of ``docs/`` cite a section of a
page as ``docs/<page>.md, "Section"`` (also ``docs/<page>.md "Section"``, with the path
in backticks, or the name in parentheses); the name may wrap across lines of a comment
(``#`` and indentation between). A cited name is a page's ``## `` heading, or the part
of one before a colon ("Dedup memory" for "Dedup memory: inbox tombstones …").
``tests/unit/test_docs_citations.py`` checks every citation of the searched tree with
these functions.

The explanation pages were once one document, ``docs/architecture.md``; its sections now
live in the pages of ``docs/explanation/``, each title used once across those pages. So:

- ``python -m txbox_tools.citations`` lists every citation whose page has no such
  section (or does not exist), and every file that still names the old document, and
  exits 1 if there is any;
- ``python -m txbox_tools.citations --rewrite`` first rewrites each citation of
  ``docs/architecture.md`` to the explanation page whose heading it names, then lists
  what is left the same way. Run it again after merging work that still cites the old
  document.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # <clone>/tools/txbox_tools/citations.py
OLD = "docs/architecture.md"
PAGES = "docs/explanation"
# Where citations live. Generated and vendored trees are not ours to check, nor the two
# files whose examples are not citations: this module and its test.
SEARCHED = (
    "framework", "migrations", "examples", "contracts", "scripts", "tests", "tools", "docs", "benchmarks", ".ci",
    "README.md", "RELIABILITY.md", "CONTRIBUTING.md", "Makefile", "pyproject.toml", "mkdocs.yml",
    ".pre-commit-config.yaml", "docker-compose.yml",
)  # fmt: skip
SUFFIXES = {".py", ".md", ".sh", ".js", ".sql", ".toml", ".yml", ".yaml", ".ini", ".cfg", ".html", ".mako", ""}
SKIPPED_PARTS = {"node_modules", "__pycache__"}
EXCLUDED = ("tools/txbox_tools/citations.py", "tests/unit/test_docs_citations.py")

# The page path, its optional closing backtick and comma, blanks, an optional "(", the name.
_CITATION = re.compile(r'\bdocs/((?:[\w-]+/){0,8}[\w-]+\.md)`?,?[ \t\n]+\(?"([^"\n]{1,200})"')
_CONTINUATION = re.compile(r"\n[ \t]*(?:#[ \t]*)?")
_FENCE = re.compile(r"^\s*(```|~~~)")
_SNIPPET = re.compile(r'^\s*--8<--\s+"([^"]+)"\s*$')
_SNIPPET_DEPTH = 4


@dataclasses.dataclass(frozen=True)
class Citation:
    """One citation: the page as written (``docs/...md``), the section's name, where the path is."""

    page: str
    name: str
    start: int  # offsets of the page path in the file's text, for the rewrite
    end: int
    line: int


def citing_files(root: Path = ROOT) -> list[Path]:
    """Every file of the searched tree, in a stable order."""
    excluded = {root / e for e in EXCLUDED}
    files: list[Path] = []
    for entry in SEARCHED:
        path = root / entry
        if path.is_file():
            files.append(path)
            continue
        for folder, subfolders, names in os.walk(path):
            subfolders[:] = sorted(d for d in subfolders if d not in SKIPPED_PARTS)
            files += [Path(folder, n) for n in sorted(names) if Path(n).suffix in SUFFIXES]
    return [f for f in files if f not in excluded]


def _flatten(text: str) -> tuple[str, list[int]]:
    """The text with comment continuations joined into one blank, and each flat index's raw offset."""
    pieces: list[str] = []
    offsets: list[int] = []
    pos = 0
    for m in _CONTINUATION.finditer(text):
        pieces.append(text[pos : m.start()])
        offsets.extend(range(pos, m.start()))
        pieces.append(" ")
        offsets.append(m.start())
        pos = m.end()
    pieces.append(text[pos:])
    offsets.extend(range(pos, len(text)))
    return "".join(pieces), offsets


def citations(text: str) -> list[Citation]:
    """The citations in one file's text."""
    if "docs/" not in text:
        return []
    flat, offsets = _flatten(text)
    found = []
    for m in _CITATION.finditer(flat):
        start, end = offsets[m.start(1)] - len("docs/"), offsets[m.end(1) - 1] + 1
        name = " ".join(m.group(2).split()).rstrip(".,")
        found.append(Citation(f"docs/{m.group(1)}", name, start, end, text.count("\n", 0, start) + 1))
    return found


def _snippet(root: Path, spec: str) -> str:
    path, _, section = spec.partition(":")
    try:
        text = (root / path).read_text(encoding="utf-8")
    except OSError:
        return ""
    if not section:
        return text
    start, end = f"--8<-- [start:{section}]", f"--8<-- [end:{section}]"
    if start not in text:
        return ""
    return text.split(start, 1)[1].split(end, 1)[0]


def _headings_of(text: str, root: Path, depth: int) -> list[str]:
    found: list[str] = []
    fenced = False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        elif fenced:
            continue
        elif line.startswith("## "):
            found.append(" ".join(line[3:].split()))
        elif depth < _SNIPPET_DEPTH and (m := _SNIPPET.match(line)):
            found += _headings_of(_snippet(root, m.group(1)), root, depth + 1)
    return found


def headings(page: Path, root: Path = ROOT) -> list[str]:
    """A page's ``## `` headings, outside code blocks, those of files it includes (``--8<--``) among them."""
    try:
        text = page.read_text(encoding="utf-8")
    except OSError:
        return []
    return _headings_of(text, root, 0)


def names_section(name: str, heading: str) -> bool:
    """Whether a cited name names this heading: equal, or the heading begins with the name and a colon."""
    return heading == name or heading.startswith(f"{name}:")


def section_index(root: Path = ROOT) -> dict[str, list[str]]:
    """Every heading of the explanation pages, with the pages (``docs/explanation/x.md``) that have it."""
    index: dict[str, list[str]] = {}
    for page in sorted((root / PAGES).glob("*.md")):
        for heading in headings(page, root):
            index.setdefault(heading, []).append(page.relative_to(root).as_posix())
    return index


def duplicates(index: dict[str, list[str]]) -> dict[str, list[str]]:
    """Headings used more than once across the explanation pages: citations of them are ambiguous."""
    return {heading: pages for heading, pages in index.items() if len(pages) > 1}


def page_for(name: str, index: dict[str, list[str]]) -> list[str]:
    """The explanation pages with a section the name names (one, unless ambiguous or gone)."""
    return sorted({page for heading, pages in index.items() if names_section(name, heading) for page in pages})


@dataclasses.dataclass(frozen=True)
class Problem:
    path: Path
    line: int
    what: str


def problems(root: Path = ROOT, files: Iterable[Path] | None = None) -> list[Problem]:
    """Citations that point at nothing, and mentions of the old document, in the searched tree."""
    index = section_index(root)
    cache: dict[str, list[str]] = {}
    found: list[Problem] = []
    for path in citing_files(root) if files is None else files:
        text = path.read_text(encoding="utf-8", errors="replace")
        cited = citations(text)
        for c in cited:
            if c.page == OLD:
                pages = page_for(c.name, index)
                hint = f"now in {pages[0]}: run with --rewrite" if len(pages) == 1 else _unmapped(pages)
                found.append(Problem(path, c.line, f'{c.page}, "{c.name}": {hint}'))
                continue
            if c.page not in cache:
                cache[c.page] = headings(root / c.page, root)
            if not (root / c.page).is_file():
                found.append(Problem(path, c.line, f'{c.page}, "{c.name}": no such page'))
            elif not any(names_section(c.name, h) for h in cache[c.page]):
                found.append(Problem(path, c.line, f'{c.page}, "{c.name}": the page has no such section'))
        cited_at = {c.start for c in cited}
        for m in re.finditer(re.escape(OLD), text):
            if m.start() not in cited_at:
                line = text.count("\n", 0, m.start()) + 1
                found.append(Problem(path, line, f"names {OLD} without a section: point it at a page by hand"))
    return sorted(found, key=lambda p: (str(p.path), p.line))


def _unmapped(pages: list[str]) -> str:
    if not pages:
        return f"no section of {PAGES}/ has that title: move the section or fix the name"
    return "ambiguous, sections of that title in " + ", ".join(pages)


def rewrite(root: Path = ROOT) -> list[Path]:
    """Point every citation of the old document at the explanation page that has its section.

    Citations whose section no page has, or several pages have, are left as they are (the
    listing names them). Returns the files changed.
    """
    index = section_index(root)
    changed: list[Path] = []
    for path in citing_files(root):
        text = path.read_text(encoding="utf-8", errors="replace")
        moves = []
        for c in citations(text):
            pages = page_for(c.name, index) if c.page == OLD else []
            if len(pages) == 1:
                moves.append((c, pages[0]))
        if not moves:
            continue
        for c, page in sorted(moves, key=lambda m: m[0].start, reverse=True):
            text = text[: c.start] + page + text[c.end :]
        path.write_text(text, encoding="utf-8")
        changed.append(path)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m txbox_tools.citations",
        description="Check citations of the docs' sections; --rewrite moves those of the old document first.",
    )
    parser.add_argument(
        "--rewrite", action="store_true", help=f"point citations of {OLD} at the page that has the section"
    )
    parser.add_argument("--root", type=Path, default=ROOT, help="the clone (default: the one these tools are in)")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    twice = duplicates(section_index(root))
    for heading, pages in sorted(twice.items()):
        print(f'section title used more than once: "{heading}" in {", ".join(pages)}')
    if args.rewrite and not twice:
        for path in rewrite(root):
            print(f"rewrote {path.relative_to(root)}")
    left = problems(root)
    for p in left:
        print(f"{p.path.relative_to(root)}:{p.line}: {p.what}")
    return 1 if left or twice else 0


if __name__ == "__main__":
    sys.exit(main())
