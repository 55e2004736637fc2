"""The outbox relay against the real PostgreSQL and RabbitMQ: what it sends, order, failures."""

from __future__ import annotations

import queue
import threading
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pika
import psycopg
from psycopg import sql

from framework import names
from framework.db import conninfo
from framework.envelope import parse_message
from framework.relay import Relay, RelayConfig
from framework.service import Service
from framework.settings import Settings
from framework.sql import outbox as outbox_sql
from framework.sql.outbox import Claimed
from tests.integration.publisher.conftest import (
    drain_queue,
    inbox_queue,
    insert_rows,
    orders,
    outbox_state,
    running_relay,
)
from tests.support import wait_until

FAST = {"poll_interval": 0.2, "retry_base": 0.05, "retry_cap": 0.2}


def test_message_carries_the_envelope_and_amqp_properties(settings: Settings, service: Service) -> None:
    (message_id,) = insert_rows(
        settings,
        service.registry,
        [
            {
                "message_type": "PlaceOrder",
                "aggregate_id": "o-1",
                "payload": {"customer": "ada", "sku": "SKU-1", "quantity": 2},
                "message_context": {"example_correlation_id": "corr-1"},
                "auth_token": "tok-123",
            }
        ],
    )
    with running_relay(service):
        wait_until(lambda: outbox_state(settings)["processed"] == 1, 30, message="the row is marked published")
    (got,) = drain_queue(settings.amqp_url, inbox_queue(settings))
    message = parse_message(json_bytes(got.body))
    assert str(message.message_id) == message_id
    assert message.payload == {"customer": "ada", "sku": "SKU-1", "quantity": 2}
    assert message.message_context == {"example_correlation_id": "corr-1"}
    assert message.auth_token == "tok-123"
    assert (message.message_type, message.aggregate_type, message.aggregate_id) == ("PlaceOrder", "order", "o-1")
    assert list(got.body)[:4] == ["payload", "message_context", "message_id", "timestamp"]
    props = got.properties
    assert props.message_id == message_id
    assert props.type == "PlaceOrder"
    assert props.content_type == "application/json"
    assert props.delivery_mode == 2
    assert props.headers == {names.HEADER_CORRELATION_ID: "corr-1"}
    with psycopg.connect(conninfo(settings.database_url)) as conn:
        created, stamp, started, finished = conn.execute(
            "SELECT created_at, processed_at, started_attempts, finished_attempts FROM txbox.outbox"
        ).fetchone()  # type: ignore[misc]
    assert message.timestamp == created.replace(microsecond=created.microsecond // 1000 * 1000)
    assert props.timestamp == int(created.timestamp())
    assert stamp is not None and (started, finished) == (1, 1)
    assert got.exchange == "command" and got.routing_key == "order-service.order.place"


def json_bytes(body: dict) -> bytes:  # type: ignore[type-arg]
    import json

    return json.dumps(body).encode()


def test_three_publishers_keep_order_per_segment(settings: Settings, service: Service) -> None:
    """20 segments x 200 messages, 3 relays racing: each segment arrives in creation order."""
    insert_rows(settings, service.registry, orders(20, 100))
    # At most 6 messages in flight each: no relay can hold the heads of all 20 lanes, so
    # all three take part however fast one of them is (on a fast machine two relays
    # without that limit kept every lane busy and the third published nothing).
    configs = [
        RelayConfig(batch_size=b, max_in_flight=6, poll_interval=0.05)  # type: ignore[arg-type]
        for b in (7, 13, 50)
    ]
    relays = [Relay(service, c) for c in configs]
    threads = [threading.Thread(target=r.run, daemon=True) for r in relays]
    for t in threads:
        t.start()
    try:
        insert_rows(
            settings,
            service.registry,
            [dict(r, payload={**r["payload"], "quantity": r["payload"]["quantity"] + 100}) for r in orders(20, 100)],
        )
        wait_until(lambda: outbox_state(settings)["processed"] == 4000, 120, message="4000 rows published")
    finally:
        for r in relays:
            r.stop()
        for t in threads:
            t.join(30)
    assert sum(r.published for r in relays) == 4000
    assert all(r.published > 0 for r in relays), [r.published for r in relays]
    seen: dict[str, list[int]] = {}
    for d in drain_queue(settings.amqp_url, inbox_queue(settings)):
        seen.setdefault(d.body["aggregate_id"], []).append(d.body["payload"]["quantity"])
    assert len(seen) == 20
    for segment, sequence in seen.items():
        assert sequence == list(range(1, 201)), f"segment {segment} out of order"


def test_higher_priority_goes_first_and_order_holds_within_a_priority(settings: Settings, service: Service) -> None:
    low = [dict(r, priority=0) for r in orders(5, 3)]
    high = [dict(r, priority=5, aggregate_id="h-" + r["aggregate_id"]) for r in orders(5, 3)]
    insert_rows(settings, service.registry, low + high)
    config = RelayConfig(batch_size=1, max_in_flight=1, poll_interval=0.05)  # type: ignore[arg-type]
    with running_relay(service, config):
        wait_until(lambda: outbox_state(settings)["processed"] == 30, 60, message="30 rows published")
    got = drain_queue(settings.amqp_url, inbox_queue(settings))
    kinds = ["high" if d.body["aggregate_id"].startswith("h-") else "low" for d in got]
    # With one message in flight the claim order is the publish order: the due heads of
    # priority 5 come before any of priority 0, until their lanes run dry.
    assert kinds[:5] == ["high"] * 5
    per: dict[str, list[int]] = {}
    for d in got:
        per.setdefault(d.body["aggregate_id"], []).append(d.body["payload"]["quantity"])
    assert all(seq == [1, 2, 3] for seq in per.values()), per


def test_parallel_rows_are_free_of_the_head_of_segment_rule(settings: Settings, service: Service) -> None:
    """A parallel row is published while an earlier sequential row of its segment waits (backoff)."""
    later = datetime.now(UTC) + timedelta(hours=1)
    insert_rows(
        settings,
        service.registry,
        [
            {**orders(1, 1)[0], "not_before": later},  # head of o-0, not due for an hour
            {**orders(1, 2)[1]},  # sequential, behind the head: must wait
            {**orders(1, 3)[2], "concurrency": "parallel"},  # free
        ],
    )
    with running_relay(service):
        wait_until(lambda: outbox_state(settings)["processed"] == 1, 30, message="the parallel row published")
    (got,) = drain_queue(settings.amqp_url, inbox_queue(settings), idle=0.5)
    assert got.body["payload"]["quantity"] == 3


def test_unroutable_command_retries_then_dead_letters_and_unroutable_event_counts_as_published(
    settings: Settings, service: Service
) -> None:
    # RestockItem goes to inventory-service, whose queue does not exist in this vhost;
    # OrderCompleted is an event nobody subscribes to.
    command_id, event_id = insert_rows(
        settings,
        service.registry,
        [
            {"message_type": "RestockItem", "aggregate_id": "SKU-1", "payload": {"sku": "SKU-1", "quantity": 5}},
            {
                "message_type": "OrderCompleted",
                "aggregate_id": "o-1",
                "payload": {"order_id": "o-1", "status": "completed"},
            },
        ],
    )
    config = RelayConfig(max_attempts=3, **FAST)  # type: ignore[arg-type]
    with running_relay(service, config) as relay:
        wait_until(lambda: outbox_state(settings)["abandoned"] == 1, 30, message="the command abandoned")
        # The relay counts a write once it has committed: a moment after the test sees it.
        wait_until(lambda: relay.abandoned == 1, 10, message="the abandonment counted")
        assert relay.published == 1 and relay.failed == 3 and relay.abandoned == 1
    with psycopg.connect(conninfo(settings.database_url)) as conn:
        rows = {
            r[0]: r[1:]
            for r in conn.execute(
                """SELECT id::text, processed_at IS NOT NULL, abandoned_at IS NOT NULL, finished_attempts,
                          started_attempts, last_error FROM txbox.outbox"""
            ).fetchall()
        }
        letters = conn.execute(
            """SELECT message_id::text, source, reason, error, message_type, message->>'message_id'
               FROM txbox.dead_letters"""
        ).fetchall()
    assert rows[event_id][:2] == (True, False)
    processed, abandoned, finished, started, error = rows[command_id]
    assert (processed, abandoned, finished, started) == (False, True, 3, 3)
    assert "unroutable" in error and "gave up after 3 attempts" in error
    assert letters == [(command_id, "outbox", "unroutable", error, "RestockItem", command_id)]


def _a_queue_that_nacks_restock(settings: Settings, service: Service) -> None:
    """A queue that rejects publishes when full makes the broker nack."""
    conn = pika.BlockingConnection(pika.URLParameters(settings.amqp_url))
    ch = conn.channel()
    ch.exchange_declare("command", exchange_type="topic", durable=True)
    ch.queue_declare("full", durable=True, arguments={"x-max-length": 0, "x-overflow": "reject-publish"})
    ch.queue_bind("full", "command", routing_key="inventory-service.stock.restock")
    conn.close()
    insert_rows(
        settings,
        service.registry,
        [{"message_type": "RestockItem", "aggregate_id": "SKU-1", "payload": {"sku": "SKU-1", "quantity": 5}}],
    )


def _finished_attempts(settings: Settings) -> int:
    with psycopg.connect(conninfo(settings.database_url)) as db:
        row = db.execute("SELECT coalesce(sum(finished_attempts), 0) FROM txbox.outbox").fetchone()
    return int(row[0]) if row else 0


def test_a_failed_publish_waits_out_its_backoff(settings: Settings, service: Service) -> None:
    _a_queue_that_nacks_restock(settings, service)
    config = RelayConfig(max_attempts=5, poll_interval=0.2, retry_base=30, retry_cap=300)  # type: ignore[arg-type]
    with running_relay(service, config):
        # The claim leases the row too: wait for the nack's outcome, not just a lease.
        wait_until(lambda: _finished_attempts(settings) == 1, 30, message="the nacked row backed off")
        with psycopg.connect(conninfo(settings.database_url)) as db:
            finished, wait, error = db.execute(  # type: ignore[misc]
                "SELECT finished_attempts, extract(epoch FROM locked_until - now()), last_error FROM txbox.outbox"
            ).fetchone()
    # First retry: base 30 s, ±50 % jitter; not abandoned, not retried meanwhile.
    assert finished == 1 and 14 <= float(wait) <= 46 and "nacked" in error
    assert outbox_state(settings)["abandoned"] == 0


def test_nacked_command_is_a_failure_with_backoff(settings: Settings, service: Service) -> None:
    _a_queue_that_nacks_restock(settings, service)
    config = RelayConfig(max_attempts=2, **FAST)  # type: ignore[arg-type]
    with running_relay(service, config):
        wait_until(lambda: outbox_state(settings)["abandoned"] == 1, 30, message="the nacked command abandoned")
    with psycopg.connect(conninfo(settings.database_url)) as db:
        reason, error = db.execute("SELECT reason, error FROM txbox.dead_letters").fetchone()  # type: ignore[misc]
        last_error = db.execute("SELECT last_error FROM txbox.outbox").fetchone()[0]  # type: ignore[index]
    assert reason == "nacked" and "nacked" in error and error == last_error


def test_notify_wakes_the_publisher_long_before_the_poll_interval(settings: Settings, service: Service) -> None:
    config = RelayConfig(poll_interval=3600)  # type: ignore[arg-type]

    def idle_and_listening() -> bool:
        # Listening on its one connection, and the claim its start made is over, or that
        # claim, not the NOTIFY, could publish the rows.
        return relay.idle

    with running_relay(service, config) as relay:
        wait_until(idle_and_listening, 30, message="the relay listening and idle")
        insert_rows(settings, service.registry, orders(3, 1))
        # Without NOTIFY nothing would happen for an hour.
        wait_until(lambda: outbox_state(settings)["processed"] == 3, 30, message="rows published after NOTIFY")


def test_a_lane_drains_without_notify_or_poll_as_each_mark_frees_its_successor(
    settings: Settings, service: Service
) -> None:
    # No poll for an hour; only the first row's insert NOTIFYs a claim. Each later row of
    # the lane becomes due when its predecessor's mark commits, and something must say
    # so: the claim that took the predecessor (has_next), whose confirm then wakes the
    # relay to mark it and claim the successor in one statement.
    config = RelayConfig(poll_interval=3600)  # type: ignore[arg-type]
    with running_relay(service, config) as relay:
        wait_until(lambda: relay.idle, 30, message="the relay idle")
        insert_rows(settings, service.registry, orders(1, 5))
        wait_until(lambda: outbox_state(settings)["processed"] == 5, 30, message="the whole lane published")
    got = drain_queue(settings.amqp_url, inbox_queue(settings), idle=0.5)
    assert [d.body["payload"]["quantity"] for d in got] == [1, 2, 3, 4, 5]


def _on_the_loop(relay: Relay, query: str) -> list[Any]:
    """``query``'s rows on the relay's own connection (prepared statements are its
    session's), run on the relay's loop while it is idle: the connection is the loop's,
    and a claim of the poll may be on it at any moment."""
    answer: queue.Queue[Any] = queue.Queue()

    def ask() -> None:
        if not relay.idle:
            relay.loop.call_later(0.01, ask)  # type: ignore[union-attr]
            return
        try:
            answer.put(relay._db.get().execute(query).fetchall())
        except Exception as exc:  # raised in the test's thread
            answer.put(exc)

    assert relay.loop is not None
    relay.loop.add_callback_threadsafe(ask)
    got = answer.get(timeout=30)
    if isinstance(got, Exception):
        raise got
    return list(got)


def test_the_relay_plans_its_claims_once_not_on_every_claim(settings: Settings, service: Service) -> None:
    # Left to choose, PostgreSQL planned every claim again (its plans for the values at
    # hand looked cheaper), about half a millisecond of its CPU per claim; the relay's
    # connections keep one generic plan (docs/explanation/daemons.md, "Generic plans").
    with running_relay(service) as relay:
        for n in range(8):  # one claim each: psycopg prepares a statement from its 5th run
            insert_rows(settings, service.registry, orders(1, 1, segment=f"plan-{n}"))
            wait_until(lambda n=n: outbox_state(settings)["processed"] == n + 1, 30, message="the row published")
        plans = _on_the_loop(
            relay, "SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE statement LIKE '%taken AS%'"
        )
    assert plans and sum(generic for generic, _ in plans) >= 1, plans
    assert all(custom == 0 for _, custom in plans), plans


def test_rows_not_due_yet_stay_put(settings: Settings, service: Service) -> None:
    later = datetime.now(UTC) + timedelta(hours=1)
    insert_rows(settings, service.registry, [{**orders(1, 1)[0], "not_before": later}])
    marker = insert_rows(settings, service.registry, orders(1, 1, segment=f"other-{uuid.uuid4()}"))
    with running_relay(service):
        wait_until(lambda: outbox_state(settings)["processed"] == 1, 30, message="the due row published")
    (got,) = drain_queue(settings.amqp_url, inbox_queue(settings), idle=0.5)
    assert got.body["message_id"] == marker[0]


def test_claimed_rows_are_read_by_column_name_in_any_order(settings: Settings) -> None:
    """fetch_claimed takes the claim's columns by name: reordered, or some left to their defaults."""
    values = {name: f"'{name}'" for name in Claimed._fields}
    values.update(priority="1", epoch="2", started_attempts="3", finished_attempts="4", trace="NULL", expires_at="NULL")
    every = list(reversed(Claimed._fields))
    fewer = [name for name in every if name not in ("segment", "concurrency", "trace", "expires_at")]
    with psycopg.connect(conninfo(settings.database_url)) as conn:
        for names_ in (every, fewer):
            select = sql.SQL("SELECT " + ", ".join(f"{values[n]} AS {n}" for n in names_))
            (row,) = outbox_sql.fetch_claimed(conn, select, {})
            assert (row.id, row.kind, row.priority, row.finished_attempts) == ("id", "kind", 1, 4)
            assert row.segment == ("segment" if names_ is every else "")
            assert row.concurrency == ("concurrency" if names_ is every else "sequential")
        # In the claim's own order the rows are made as they come, with no mapping per row.
        in_order = sql.SQL("SELECT " + ", ".join(f"{values[n]} AS {n}" for n in Claimed._fields))
        with conn.cursor() as cur:
            cur.execute(in_order)
            assert outbox_sql._claimed(cur) == Claimed._make
        # A column of another name, non-ASCII in a one-byte client encoding, is passed over.
        conn.execute("SET client_encoding TO 'LATIN1'")
        extra = sql.SQL("SELECT " + ", ".join(f"{values[n]} AS {n}" for n in every) + ', 1 AS "café"')
        (row,) = outbox_sql.fetch_claimed(conn, extra, {})
        assert (row.id, row.priority) == ("id", 1)


def test_a_claim_marks_the_rows_it_carries_and_takes_their_successors_at_once(
    settings: Settings, service: Service
) -> None:
    # The relay's marks ride its next claim (docs/explanation/daemons.md, "Wake-ups"): the
    # claim must see a marked row's successor as the head of its lane in the same
    # statement, say of each row whether a pending row waits behind it, and date each
    # mark at its confirm, not at the claim.
    registry = service.registry
    first, second = insert_rows(settings, registry, orders(1, 2))
    (lone,) = insert_rows(settings, registry, orders(1, 1, aggregate_id="lone"))
    claim = outbox_sql.claim_window(settings.schema)
    params = {"window": 40, "limit": 10, "lease": 60.0}
    with psycopg.connect(conninfo(settings.database_url), autocommit=True) as conn:
        rows = outbox_sql.fetch_claimed(conn, claim, {**params, "marked": [], "ages": []})
        assert {(r.id, r.has_next) for r in rows} == {(first, True), (lone, False)}
        # The first row's confirm came 5 s before the lone one's: its mark says so.
        (row,) = outbox_sql.fetch_claimed(conn, claim, {**params, "marked": [first, lone], "ages": [5.0, 0.0]})
        assert (row.id, row.has_next) == (second, False)
        marked = conn.execute(
            sql.SQL(
                "SELECT id::text, finished_attempts, extract(epoch FROM processed_at) FROM {}"
                " WHERE processed_at IS NOT NULL"
            ).format(sql.Identifier(settings.schema, "outbox"))
        ).fetchall()
    assert sorted((m[0], m[1]) for m in marked) == sorted([(first, 1), (lone, 1)])
    at = {m[0]: float(m[2]) for m in marked}
    assert 4.9 < at[lone] - at[first] < 5.5


def test_each_mark_rides_a_claim_and_no_claim_comes_back_empty(settings: Settings, service: Service) -> None:
    # A cycle is one statement (docs/explanation/daemons.md, "Wake-ups"): the claim of the next
    # NOTIFY marks what was confirmed. Here no NOTIFY follows each row (the test waits for
    # its mark first), so the mark waits MARK_DELAY and then goes alone, one statement,
    # rather than in a claim that would find nothing. Nothing else is written.
    rows = 4
    with running_relay(service, RelayConfig(poll_interval=3600)) as relay:  # type: ignore[arg-type]
        wait_until(lambda: relay.idle, 30, message="the relay idle")
        before = dict(relay.statements)
        for n in range(1, rows + 1):
            insert_rows(settings, service.registry, orders(1, 1, aggregate_id=f"t-{n}"))
            wait_until(lambda n=n: outbox_state(settings)["processed"] == n, 30, message=f"row {n} marked")
        wait_until(lambda: relay.published == rows, 30, message="the marks counted")
        after = dict(relay.statements)
    spent = {kind: after.get(kind, 0) - before.get(kind, 0) for kind in ("claim", "mark", "write")}
    assert spent == {"claim": rows, "mark": rows, "write": 0}, spent
    assert len(drain_queue(settings.amqp_url, inbox_queue(settings), idle=0.5)) == rows


def test_under_load_the_next_notify_claim_carries_the_marks(settings: Settings, service: Service) -> None:
    # Rows that come faster than their confirms: every mark but the last rides the claim
    # of a later row's NOTIFY, so there are fewer statements than rows plus marks.
    rows = 20
    with running_relay(service, RelayConfig(poll_interval=3600)) as relay:  # type: ignore[arg-type]
        wait_until(lambda: relay.idle, 30, message="the relay idle")
        before = dict(relay.statements)
        for n in range(rows):
            insert_rows(settings, service.registry, orders(1, 1, aggregate_id=f"u-{n}"))
        wait_until(lambda: outbox_state(settings)["processed"] == rows, 30, message="every row marked")
        wait_until(lambda: relay.published == rows, 30, message="the marks counted")
        after = dict(relay.statements)
    claims = after.get("claim", 0) - before.get("claim", 0)
    marks = after.get("mark", 0) - before.get("mark", 0)
    assert after.get("write", 0) == before.get("write", 0)
    assert claims <= rows and marks <= claims, (claims, marks)
    assert len(drain_queue(settings.amqp_url, inbox_queue(settings), idle=0.5)) == rows
