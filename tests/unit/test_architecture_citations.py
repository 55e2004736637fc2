"""Every citation of docs/architecture.md names a section the document has.

Code comments, docstrings, the README and the pages of docs/ cite the document as
``docs/architecture.md, "Section"``; a section renamed or dropped would leave them
pointing at nothing. A cited name matches a heading equal to it, or one that begins
with it followed by a colon ("Dedup memory" for "Dedup memory: inbox tombstones …").
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCUMENT = ROOT / "docs" / "architecture.md"
# Where citations live; generated and vendored trees are not ours to check, nor this
# file, whose examples are not citations.
SEARCHED = (
    "framework", "migrations", "examples", "scripts", "tests", "tools", "docs",
    "README.md", "RELIABILITY.md", "CONTRIBUTING.md", "benchmarks",
)  # fmt: skip
SUFFIXES = {".py", ".md", ".sh", ".js", ".sql", ".toml"}
SKIPPED_PARTS = {"node_modules", "__pycache__"}
# The name may continue on the next line of a comment (``#`` and indentation between).
_CITATION = re.compile(r'docs/architecture\.md,?\s+"([^"]{1,200})"')
_CONTINUATION = re.compile(r"\n[ \t]*(?:#[ \t]*)?")


def headings() -> list[str]:
    return [line[3:].strip() for line in DOCUMENT.read_text(encoding="utf-8").splitlines() if line.startswith("## ")]


def citing_files() -> list[Path]:
    this = Path(__file__).resolve()
    files: list[Path] = []
    for entry in SEARCHED:
        path = ROOT / entry
        if path.is_file():
            files.append(path)
            continue
        for folder, subfolders, names in os.walk(path):
            subfolders[:] = sorted(d for d in subfolders if d not in SKIPPED_PARTS)
            files += [Path(folder, n) for n in sorted(names) if Path(n).suffix in SUFFIXES]
    return [f for f in files if f != this]


def citations(text: str) -> list[str]:
    flat = _CONTINUATION.sub(" ", text)
    return [" ".join(name.split()).rstrip(".,") for name in _CITATION.findall(flat)]


def cited_section_exists(name: str, sections: list[str]) -> bool:
    return any(heading == name or heading.startswith(f"{name}:") for heading in sections)


def test_every_cited_section_exists() -> None:
    sections = headings()
    missing = [
        f"{path.relative_to(ROOT)}: {name!r}"
        for path in citing_files()
        for name in citations(path.read_text(encoding="utf-8", errors="replace"))
        if not cited_section_exists(name, sections)
    ]
    assert not missing, "citations of docs/architecture.md naming no section:\n" + "\n".join(missing)


def test_the_search_finds_the_citations_it_checks() -> None:
    # A pattern that silently matched nothing would pass the test above for any document.
    found = {name for path in citing_files() for name in citations(path.read_text(encoding="utf-8", errors="replace"))}
    assert {"Dead letters", "Secrets", "Worker: handlers that misbehave", "Receiver intake"} <= found


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('see docs/architecture.md, "Dead letters").', ["Dead letters"]),
        ('(docs/architecture.md "The envelope")', ["The envelope"]),
        ('# (docs/architecture.md, "Worker: handlers\n    # that misbehave")', ["Worker: handlers that misbehave"]),
        ("no section: (docs/architecture.md)", []),
    ],
)
def test_citation_forms(text: str, expected: list[str]) -> None:
    assert citations(text) == expected


def test_a_prefix_before_a_colon_names_the_section() -> None:
    sections = ["Dedup memory: inbox tombstones and `TXBOX_DEDUP_WINDOW`", "Secrets"]
    assert cited_section_exists("Dedup memory", sections)
    assert not cited_section_exists("Dedup", sections)
    assert not cited_section_exists("Secret", sections)
