"""tests/golden/statements.sql holds every statement txbox builds, rendered whole.

txbox_tools.golden_sql renders the statements again from the code; a committed file that
differs fails here with the diff, so a change to any statement (or to a fragment several
of them share) shows in review as the full text of each statement it changes.
Regenerate with ``python -m txbox_tools.golden_sql``.
"""

from __future__ import annotations

import pytest

from txbox_tools import golden_sql


def test_the_golden_sql_file_is_what_the_code_renders() -> None:
    diff = golden_sql.check()
    if diff is not None:
        pytest.fail(
            f"{golden_sql.PATH} differs from the statements the code builds; review the diff below, "
            f"then regenerate it with `python -m txbox_tools.golden_sql`:\n{diff}",
            pytrace=False,
        )


def test_every_entry_has_one_header_and_the_headers_are_unique() -> None:
    headers = [header for header, _ in golden_sql.statements()]
    assert len(headers) == len(set(headers)), "two entries share a header"
    text = golden_sql.render()
    assert all(text.count(f"\n-- {header}\n") == 1 for header in headers)
    # The variants the worker builds at start-up are all there (framework/worker/daemon.py).
    for suspects in (False, True):
        for park in (False, True):
            assert f"framework.sql.inbox.claim(txbox, suspects={suspects}, park={park})" in headers
