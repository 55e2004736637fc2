"""Ordering: sequential segments strictly in order with several workers.

docs/explanation/guarantees.md, "Guarantees and how they are kept".
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

from framework import CommandHandler, Message, Outbox, PermanentError, RetryableError
from framework.service import Service
from framework.worker import Worker, WorkerConfig
from tests import support
from tests.apps.helpers import place_order, query, running, scalar, store_in_inbox

FAST = {"backoff_base": 0.05, "backoff_cap": 0.1, "poll_interval": 0.1, "batch_size": 20}


class Sequenced(CommandHandler):
    """Records (segment, sequence number) in commit order; fails where told to."""

    message_type = "PlaceOrder"

    def __init__(self, fail: dict[tuple[str, int], type[Exception]] | None = None, failures: int = 2) -> None:
        self.fail = fail or {}
        self.failures = failures

    def handle(self, message: Message, session: Session, outbox: Outbox) -> None:
        key = (message.aggregate_id, message.payload["quantity"])
        if key in self.fail and (self.fail[key] is PermanentError or message.attempt <= self.failures):
            raise self.fail[key](f"{key} fails")
        support.pause(random.uniform(0, 0.002))  # work of its own: lets the workers interleave
        session.execute(
            text("INSERT INTO seen (segment, seq) VALUES (:s, :q)"), {"s": message.aggregate_id, "q": key[1]}
        )


@pytest.fixture
def business(database_url: str) -> str:
    query(database_url, "CREATE TABLE seen (n bigserial PRIMARY KEY, segment text NOT NULL, seq int NOT NULL)")
    return database_url


def order_seen(url: str) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for segment, seq in query(url, "SELECT segment, seq FROM seen ORDER BY n"):
        out.setdefault(segment, []).append(seq)
    return out


def settled(url: str) -> int:
    return int(
        scalar(url, "SELECT count(*) FROM txbox.inbox WHERE processed_at IS NOT NULL OR abandoned_at IS NOT NULL")
    )


def workers(service: Service, n: int = 3, **overrides: Any) -> list[Worker]:
    return [Worker(service, WorkerConfig(**{**FAST, **overrides})) for _ in range(n)]


def segments(count: int, length: int) -> list[dict[str, Any]]:
    """Messages of ``count`` segments, interleaved as they would arrive."""
    return [place_order(aggregate_id=f"s{s}", quantity=q) for q in range(1, length + 1) for s in range(count)]


def test_three_workers_keep_every_segment_in_order(service: Service, business: str) -> None:
    service.register(Sequenced())
    store_in_inbox(service, segments(8, 25))
    w1, w2, w3 = workers(service)
    with running(w1), running(w2), running(w3):
        support.wait_until(lambda: settled(business) == 200, 60, message="all 200 processed")
    seen = order_seen(business)
    assert len(seen) == 8
    for segment, seqs in seen.items():
        assert seqs == list(range(1, 26)), f"segment {segment} out of order: {seqs}"


def test_a_failing_message_holds_back_its_segment_only(service: Service, business: str) -> None:
    service.register(Sequenced(fail={("s0", 2): RetryableError}, failures=2))
    store_in_inbox(service, segments(3, 5))
    w1, w2, w3 = workers(service)
    with running(w1), running(w2), running(w3):
        support.wait_until(lambda: settled(business) == 15, 30, message="all processed")
    seen = order_seen(business)
    assert seen["s0"] == [1, 2, 3, 4, 5], "later messages must wait for the failing one"
    assert seen["s1"] == seen["s2"] == [1, 2, 3, 4, 5]
    attempts = scalar(
        business, "SELECT finished_attempts FROM txbox.inbox WHERE aggregate_id = 's0' AND payload->>'quantity' = '2'"
    )
    assert attempts == 3


def test_after_an_abandon_the_segment_proceeds_by_default(service: Service, business: str) -> None:
    service.register(Sequenced(fail={("s0", 2): PermanentError}))
    store_in_inbox(service, segments(2, 4))
    w1, w2, w3 = workers(service)
    with running(w1), running(w2), running(w3):
        support.wait_until(lambda: settled(business) == 8, 30, message="all settled")
    assert order_seen(business)["s0"] == [1, 3, 4]


def test_park_policy_holds_the_segment_until_the_dead_letter_is_discarded(service: Service, business: str) -> None:
    service.register(Sequenced(fail={("s0", 2): PermanentError}))
    store_in_inbox(service, segments(2, 4))
    w1, w2 = workers(service, 2, segment_policy="park")
    with running(w1), running(w2):
        support.wait_until(lambda: order_seen(business).get("s1") == [1, 2, 3, 4], 30, message="the other segment")
        support.wait_until(lambda: scalar(business, "SELECT count(*) FROM txbox.dead_letters") == 1, 30,
                           message="the abandon")  # fmt: skip
        # A message stored after the abandon is processed: the workers kept claiming.
        store_in_inbox(service, [place_order(aggregate_id="later", quantity=1)])
        support.wait_until(lambda: "later" in order_seen(business), 30, message="a later message")
        assert order_seen(business)["s0"] == [1], "later messages stay parked behind the dead letter"
        query(business, "UPDATE txbox.dead_letters SET discarded_at = now()")
        support.wait_until(lambda: order_seen(business)["s0"] == [1, 3, 4], 30, message="the segment to resume")
