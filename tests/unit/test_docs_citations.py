"""Every citation of a documentation page names a section the page has.

Code comments, docstrings, the README and the pages of docs/ cite a section as
``docs/<page>.md, "Section"``; a section renamed, moved or dropped would leave them
pointing at nothing. A cited name matches a ``## `` heading of that page equal to it, or
one that begins with it followed by a colon ("Dedup memory" for "Dedup memory: inbox
tombstones …"). The explanation pages were one document, docs/architecture.md, until its
sections moved into docs/explanation/: nothing may name it any more, and
``python -m txbox_tools.citations --rewrite`` moves citations that still do
(txbox_tools/citations.py, which this test checks with).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from txbox_tools import citations as c

ROOT = c.ROOT


def _all() -> list[tuple[Path, c.Citation]]:
    return [
        (path, cited)
        for path in c.citing_files(ROOT)
        for cited in c.citations(path.read_text(encoding="utf-8", errors="replace"))
    ]


def test_every_cited_section_exists() -> None:
    found = c.problems(ROOT)
    assert not found, "citations naming no section, or the old document:\n" + "\n".join(
        f"{p.path.relative_to(ROOT)}:{p.line}: {p.what}" for p in found
    )


def test_no_citation_names_the_old_document() -> None:
    old = [f"{path.relative_to(ROOT)}:{cited.line}" for path, cited in _all() if cited.page == c.OLD]
    assert old == []
    assert not (ROOT / c.OLD).exists()


def test_the_search_finds_the_citations_it_checks() -> None:
    # A pattern that silently matched nothing would pass the tests above for any page.
    found = {(cited.page, cited.name) for _, cited in _all()}
    assert {
        ("docs/explanation/dead-letters.md", "Dead letters"),
        ("docs/explanation/operations.md", "Secrets"),
        ("docs/explanation/handle.md", "Worker: handlers that misbehave"),
        ("docs/explanation/receive.md", "Receiver intake"),
    } <= found
    # Comments of the Makefile and pyproject.toml cite sections too.
    searched = {path.relative_to(ROOT).as_posix() for path in c.citing_files(ROOT)}
    assert {"Makefile", "pyproject.toml", "framework/receiver/intake.py"} <= searched


def test_section_titles_are_unique_across_the_explanation_pages() -> None:
    index = c.section_index(ROOT)
    assert "Receiver intake" in index
    assert c.duplicates(index) == {}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('see docs/explanation/guarantees.md, "Secrets").', [("docs/explanation/guarantees.md", "Secrets")]),
        ('(docs/explanation/relay.md "The envelope")', [("docs/explanation/relay.md", "The envelope")]),
        (
            '# (docs/explanation/handle.md, "Worker: handlers\n    # that misbehave")',
            [("docs/explanation/handle.md", "Worker: handlers that misbehave")],
        ),
        ('# (docs/architecture.md,\n# "Retention")', [("docs/architecture.md", "Retention")]),
        ('`docs/how-to/daemons.md`, "Scaling"', [("docs/how-to/daemons.md", "Scaling")]),
        ('docs/explanation/receive.md ("Receiver intake") says', [("docs/explanation/receive.md", "Receiver intake")]),
        ("no section: (docs/explanation/receive.md)", []),
    ],
)
def test_citation_forms(text: str, expected: list[tuple[str, str]]) -> None:
    assert [(cited.page, cited.name) for cited in c.citations(text)] == expected


def test_a_citation_knows_where_its_path_is() -> None:
    text = 'x = 1\n# see (docs/architecture.md,\n#   "Worker: handlers that\n#   misbehave")\n'
    (cited,) = c.citations(text)
    assert text[cited.start : cited.end] == "docs/architecture.md"
    assert cited.line == 2


def test_a_prefix_before_a_colon_names_the_section() -> None:
    assert c.names_section("Dedup memory", "Dedup memory: inbox tombstones and `TXBOX_DEDUP_WINDOW`")
    assert not c.names_section("Dedup", "Dedup memory: inbox tombstones and `TXBOX_DEDUP_WINDOW`")
    assert not c.names_section("Secret", "Secrets")
    assert c.names_section("Secrets", "Secrets")


def _tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_rewrite_moves_citations_of_the_old_document(tmp_path: Path) -> None:
    _tree(
        tmp_path,
        {
            "docs/explanation/receive.md": "# Receiving\n\n## Receiver intake\n\ntext\n",
            "docs/explanation/guarantees.md": "# G\n\n## Dedup memory: tombstones\n\n```\n## not a heading\n```\n",
            "framework/a.py": (
                '"""Doc (docs/architecture.md, "Receiver intake")."""\n'
                "# and (docs/architecture.md,\n"
                '#   "Dedup memory")\n'
                '# gone: docs/architecture.md, "Nowhere"\n'
            ),
            "README.md": "see docs/architecture.md for all\n",
        },
    )
    assert c.headings(tmp_path / "docs/explanation/guarantees.md", tmp_path) == ["Dedup memory: tombstones"]
    assert [p.relative_to(tmp_path).as_posix() for p in c.rewrite(tmp_path)] == ["framework/a.py"]
    assert (tmp_path / "framework/a.py").read_text() == (
        '"""Doc (docs/explanation/receive.md, "Receiver intake")."""\n'
        "# and (docs/explanation/guarantees.md,\n"
        '#   "Dedup memory")\n'
        '# gone: docs/architecture.md, "Nowhere"\n'
    )
    left = [(p.path.relative_to(tmp_path).as_posix(), p.line, p.what.split(":")[0]) for p in c.problems(tmp_path)]
    assert left == [
        ("README.md", 1, "names docs/architecture.md without a section"),
        ("framework/a.py", 4, 'docs/architecture.md, "Nowhere"'),
    ]
    # Run again: nothing more to move.
    assert c.rewrite(tmp_path) == []


def test_a_missing_page_or_section_is_listed(tmp_path: Path) -> None:
    _tree(
        tmp_path,
        {
            "docs/how-to/a.md": "# A\n\n## One\n",
            "docs/explanation/included.md": '# I\n\n--8<-- "NOTES.md"\n',
            "NOTES.md": "# Notes\n\n## From the included file\n",
            "tests/t.py": (
                '# docs/how-to/a.md, "One"; docs/how-to/a.md, "Two"; docs/how-to/b.md, "One"\n'
                '# docs/explanation/included.md, "From the included file"\n'
            ),
        },
    )
    assert [p.what for p in c.problems(tmp_path)] == [
        'docs/how-to/a.md, "Two": the page has no such section',
        'docs/how-to/b.md, "One": no such page',
    ]


def test_a_title_on_two_pages_stops_the_rewrite(tmp_path: Path) -> None:
    _tree(
        tmp_path,
        {
            "docs/explanation/a.md": "## Twice\n",
            "docs/explanation/b.md": "## Twice\n",
            "framework/x.py": '# docs/architecture.md, "Twice"\n',
        },
    )
    assert c.main(["--rewrite", "--root", str(tmp_path)]) == 1
    assert "docs/architecture.md" in (tmp_path / "framework/x.py").read_text()
