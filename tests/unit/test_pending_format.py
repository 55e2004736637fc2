"""How `txbox outbox|inbox list` writes ages and lease ends, and what its filters accept."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime, timedelta

import pytest

from framework.cli.pending import age, duration, limit, until
from framework.sql import pending as pending_sql


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(None, "0s"), (-3, "0s"), (0.4, "0s"), (59, "59s"), (95, "1m35s"), (3600, "1h"), (7322, "2h2m"), (90061, "1d1h")],
)
def test_age_has_two_units_at_most(seconds: float | None, text: str) -> None:
    assert age(seconds) == text


def test_until_shows_only_what_still_holds() -> None:
    now = datetime.now(UTC)
    assert until(None) == "-" and until(now - timedelta(seconds=1)) == "-"
    assert until(now + timedelta(minutes=5, seconds=30)) in ("in 5m30s", "in 5m29s")


def test_filter_arguments() -> None:
    assert duration("10m") == 600 and duration("7d") == 7 * 86400 and limit("1000") == 1000
    for bad in ("", "-5m", "10x", "1e9"):
        with pytest.raises(argparse.ArgumentTypeError, match="is not an age"):
            duration(bad)
    for bad in ("0", "1001", "ten"):
        with pytest.raises(argparse.ArgumentTypeError, match="from 1 to 1000"):
            limit(bad)


def test_empty_form_fields_mean_not_given() -> None:
    f = pending_sql.Filters(table="outbox", state="", message_type="", segment="")
    assert (f.state, f.message_type, f.segment) == (None, None, None)
    assert not pending_sql.Filters(table="outbox", park=True).parks and pending_sql.Filters(park=True).parks
