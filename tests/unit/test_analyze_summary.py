"""The report `txbox analyze` prints: how to act on an abandoned message it names."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from framework.analytics import reconcile as rc
from framework.analytics.job import RunResult


def _result(sample: dict[str, Any]) -> RunResult:
    return RunResult(
        run_id="r1",
        run_at=datetime(2026, 12, 3, tzinfo=UTC),
        counts={rc.ABANDONED: 1},
        samples={rc.ABANDONED: [sample]},
        notes=[],
        outbox_rows=1,
        inbox_rows=1,
        seconds=0.1,
    )


def test_the_hint_finds_the_letter_by_message_id_and_names_the_tenant_when_there_are_tenants() -> None:
    """`txbox dlq show` takes a letter's id, not a message's; a tenant's letters are read with --tenant."""
    sample = {"message_id": "m1", "message_type": "PlaceOrder", "service": "order-service", "reason": "poison"}
    alone = _result(sample).summary()
    assert "act on a message: txbox dlq list --message-id <message id>\n" in alone + "\n"
    assert "--tenant" not in alone
    with_tenant = _result({**sample, "tenant": "t0"}).summary()
    assert "order-service/t0" in with_tenant
    assert with_tenant.endswith("act on a message: txbox dlq list --message-id <message id> --tenant <tenant>")
