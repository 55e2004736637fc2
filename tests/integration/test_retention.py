"""Retention: the publisher prunes the outbox, the worker the inbox (framework/retention.py).

Rows are written with their ages set in SQL; a pass is run directly (``pruner.run_pass``)
except in the tests that check the daemons run it themselves.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from prometheus_client import REGISTRY

from framework import metrics, names
from framework.db import conninfo
from framework.errors import ConfigurationError
from framework.relay import Relay
from framework.service import Service
from framework.settings import RetentionSettings
from framework.worker import Worker, WorkerConfig
from tests import support
from tests.apps.helpers import query, running, scalar

DAY = 86400.0


def _row(
    url: str, table: str, name: str, *, created: str, finished: str | None = None, state: str = "processed"
) -> str:
    """One row of ``table`` created ``created`` ago, finished (``state``) ``finished`` ago, or pending."""
    extra_cols, extra_vals = ("", "")
    if table == names.INBOX:
        extra_cols, extra_vals = ", message_timestamp, queue", ", now(), 'order-service:inbox'"
    done = "processed_at" if state == "processed" else "abandoned_at"
    return str(
        scalar(
            url,
            f"""INSERT INTO txbox.{table} (id, message_type, aggregate_type, aggregate_id, kind, routing_key, payload,
                   segment, created_at, {done}{extra_cols})
                VALUES (gen_random_uuid(), 'PlaceOrder', 'order', %(name)s, 'command', 'order-service.order.place',
                   jsonb_build_object('customer', %(name)s::text), %(name)s, now() - %(created)s::interval,
                   now() - %(finished)s::interval{extra_vals})
                RETURNING id""",
            {"name": name, "created": created, "finished": finished},
        )
    )


def _letter(url: str, message_id: str, source: str, status: str) -> None:
    """A dead letter (``open``, ``resolved`` or ``discarded``) of the row ``message_id``, with its envelope."""
    table = names.OUTBOX if source == "outbox" else names.INBOX
    stamp = {"open": "NULL", "resolved": "now()", "discarded": "NULL"}[status]
    discarded = "now()" if status == "discarded" else "NULL"
    query(
        url,
        f"""INSERT INTO txbox.dead_letters (message_id, source, reason, fingerprint, message, resolved_at, discarded_at)
            SELECT id, %s, 'max_attempts', 'f', jsonb_build_object('message_type', message_type, 'aggregate_type',
                   aggregate_type, 'aggregate_id', aggregate_id, 'payload', payload), {stamp}, {discarded}
            FROM txbox.{table} WHERE id = %s""",
        (source, message_id),
    )


def _ids(url: str, table: str) -> set[str]:
    return {r[0] for r in query(url, f"SELECT id::text FROM txbox.{table}")}


def _sample(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, {**metrics.labels("order-service"), **labels})


def test_the_publisher_prunes_exactly_the_outbox_rows_that_may_go_in_pages(service: Service, database_url: str) -> None:
    url = database_url
    old = [_row(url, names.OUTBOX, f"old-{n}", created="2 days", finished="2 days") for n in range(5)]
    kept = {
        "recent": _row(url, names.OUTBOX, "recent", created="3 days", finished="1 hour"),
        "pending": _row(url, names.OUTBOX, "pending", created="3 days"),
        "open letter": _row(url, names.OUTBOX, "open", created="3 days", finished="2 days", state="abandoned"),
        "one open of two": _row(url, names.OUTBOX, "other", created="3 days", finished="2 days", state="abandoned"),
    }
    query(url, "UPDATE txbox.outbox SET processed_at = NULL WHERE aggregate_id = 'pending'")
    _letter(url, kept["open letter"], "outbox", "open")
    _letter(url, kept["one open of two"], "outbox", "resolved")
    _letter(url, kept["one open of two"], "outbox", "open")  # one letter still open keeps it
    gone = {
        "resolved": _row(url, names.OUTBOX, "resolved", created="3 days", finished="2 days", state="abandoned"),
        "discarded": _row(url, names.OUTBOX, "discarded", created="3 days", finished="2 days", state="abandoned"),
        "no letter": _row(url, names.OUTBOX, "none", created="3 days", finished="2 days", state="abandoned"),
        "long ago": _row(url, names.OUTBOX, "ancient", created="41 days", finished="40 days", state="abandoned"),
    }
    _letter(url, gone["resolved"], "outbox", "resolved")
    _letter(url, gone["discarded"], "outbox", "discarded")
    _letter(url, gone["long ago"], "outbox", "open")
    before = _sample("txbox_publisher_pruned_total", state="processed") or 0.0

    relay = Relay(service, retention=RetentionSettings(retention_batch_size=2))
    done = relay.pruner.run_pass()

    assert _ids(url, names.OUTBOX) == set(kept.values())
    assert (done.processed, done.abandoned, done.locked_out) == (5, 4, False)
    assert done.pages == 5, "9 rows in pages of 2"
    assert _sample("txbox_publisher_pruned_total", state="processed") == before + 5
    assert (_sample("txbox_publisher_outbox_table_bytes") or 0) > 0
    assert (_sample("txbox_publisher_outbox_indexes_bytes") or 0) > 0
    assert _sample("txbox_publisher_outbox_dead_tuples_rows") is not None
    assert old  # all of them gone, checked above


def test_the_worker_never_prunes_inside_the_dedup_window_and_keeps_rows_with_open_letters(
    service: Service, database_url: str, monkeypatch: Any
) -> None:
    url = database_url
    monkeypatch.setenv("TXBOX_DEDUP_WINDOW", "3d")
    gone = {
        "processed": _row(url, names.INBOX, "processed", created="5 days", finished="4 days"),
        "abandoned": _row(url, names.INBOX, "abandoned", created="5 days", finished="4 days", state="abandoned"),
    }
    kept = {
        "in window": _row(url, names.INBOX, "window", created="5 days", finished="2 days"),
        "open letter": _row(url, names.INBOX, "open", created="5 days", finished="4 days", state="abandoned"),
    }
    _letter(url, kept["open letter"], "broker", "open")
    # A letter of a processed message goes on as resolved: a replay could not run it again (dedup.forget).
    _letter(url, gone["processed"], "inbox", "open")

    # Retention 1 day asked for, but ids stay for the whole dedup window: start fails, naming the fix.
    with pytest.raises(ConfigurationError, match="TXBOX_INBOX_RETENTION=259200s or more"):
        Worker(service, WorkerConfig(), retention=RetentionSettings(inbox_retention=DAY))
    worker = Worker(service, WorkerConfig(), retention=RetentionSettings(inbox_retention=3 * DAY))
    done = worker.pruner.run_pass()

    assert _ids(url, names.INBOX) == set(kept.values())
    assert (done.processed, done.abandoned) == (1, 1)
    resolved = "SELECT resolved_at IS NOT NULL FROM txbox.dead_letters WHERE message_id = %s"
    assert scalar(url, resolved, (gone["processed"],)) is True
    assert (_sample("txbox_worker_inbox_table_bytes") or 0) > 0


def test_one_pruner_per_table_at_a_time(service: Service, database_url: str) -> None:
    old = _row(database_url, names.OUTBOX, "old", created="2 days", finished="2 days")
    relay = Relay(service, retention=RetentionSettings())
    key = names.pruner_lock_key("order-service", names.OUTBOX)
    with psycopg.connect(conninfo(database_url), autocommit=True) as other:
        assert other.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone() == (True,)
        done = relay.pruner.run_pass()
        assert done.locked_out and done.processed == 0
        assert _ids(database_url, names.OUTBOX) == {old}
        # The other one is done (unlocked now: a closed connection's backend may release it a moment later).
        other.execute("SELECT pg_advisory_unlock(%s)", (key,))
        assert relay.pruner.run_pass().processed == 1


def test_the_pruners_of_two_schemas_do_not_wait_for_each_other(service: Service, database_url: str) -> None:
    """Tenants kept as schemas of one database: one tenant's pass holds no other's back."""
    old = _row(database_url, names.OUTBOX, "old", created="2 days", finished="2 days")
    relay = Relay(service, retention=RetentionSettings())
    key = names.pruner_lock_key("order-service", names.OUTBOX, "t_other")
    assert key != names.pruner_lock_key("order-service", names.OUTBOX)
    with psycopg.connect(conninfo(database_url), autocommit=True) as other:
        assert other.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone() == (True,)
        done = relay.pruner.run_pass()
    assert not done.locked_out and done.processed == 1 and old not in _ids(database_url, names.OUTBOX)


def test_the_daemons_prune_on_their_own(service: Service, database_url: str) -> None:
    outbox_row = _row(database_url, names.OUTBOX, "old", created="2 days", finished="2 days")
    inbox_row = _row(database_url, names.INBOX, "old", created="9 days", finished="8 days")
    retention = RetentionSettings(retention_interval=0.2)
    with running(Relay(service, retention=retention)), running(Worker(service, WorkerConfig(), retention=retention)):
        support.wait_until(lambda: not _ids(database_url, names.OUTBOX), 20, message="the publisher pruned")
        support.wait_until(lambda: not _ids(database_url, names.INBOX), 20, message="the worker pruned")
    assert outbox_row and inbox_row


def test_a_pass_vacuums_the_table_once_its_dead_tuples_pile_up(service: Service, database_url: str) -> None:
    """Where autovacuum lags (or is off), the pruner's VACUUM makes the deleted rows' space reusable."""
    query(
        database_url,
        """INSERT INTO txbox.outbox (id, message_type, aggregate_type, aggregate_id, kind, routing_key, payload,
               segment, created_at, processed_at)
           SELECT gen_random_uuid(), 'PlaceOrder', 'order', 'a' || i, 'command', 'r', '{}', 'a' || i,
                  now() - interval '2 days', now() - interval '2 days'
           FROM generate_series(1, 12000) AS i""",
    )
    relay = Relay(service, retention=RetentionSettings(retention_batch_size=5000))
    first = relay.pruner.run_pass()
    assert first.processed == 12000
    dead = "SELECT n_dead_tup FROM pg_stat_user_tables WHERE relid = 'txbox.outbox'::regclass"
    if not first.vacuumed:  # the deletes were not counted yet when the pass looked: the next pass sees them
        support.wait_until(lambda: scalar(database_url, dead) >= 12000, 20, message="the deletes counted")
        assert relay.pruner.run_pass().vacuumed

    support.wait_until(lambda: scalar(database_url, dead) < 12000, 20, message="the dead tuples vacuumed")
    assert _sample("txbox_publisher_outbox_dead_tuples_rows") is not None
