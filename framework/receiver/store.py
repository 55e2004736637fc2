"""Settling a batch in the database: admission, the one write of rows, letters and counters.

What a group of deliveries becomes (:class:`Prepared`: rows, dead letters, the redelivery
counters it settles) is decided here from :mod:`framework.receiver.intake`'s judgments,
and written in one transaction: the ordinary, blocking way, used for batches with
letters or counters, for redelivered deliveries settled one at a time, and for a batch
the one-round-trip write (:mod:`framework.receiver.write`) handed back. A row
PostgreSQL refuses for its data is found one savepoint at a time, and becomes an
``unstorable`` letter (docs/explanation/receive.md, "Receiver intake").

:class:`Storing` is a part of :class:`~framework.receiver.daemon.Receiver` and runs on
its loop; its statements are short and synchronous (docs/explanation/daemons.md, "One loop per
process").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from opentelemetry import trace

from framework import db, logs, metrics, tracing
from framework import dead_letters as dl
from framework.envelope import decode_json
from framework.reasons import Reason
from framework.receiver.config import ReceiverConfig
from framework.receiver.intake import Delivery, Filtered, Intake
from framework.receiver.tenancy import Store
from framework.settings import Settings
from framework.sql import dead_letters as dead_letters_sql
from framework.sql import inbox as inbox_sql
from framework.sql import redeliveries as redeliveries_sql
from framework.sql.inbox import InboxRow


@dataclass
class Prepared:
    """A group admitted: rows to store, dead letters, and the redelivery counters it settles."""

    pairs: list[tuple[Delivery, InboxRow]]
    letters: list[tuple[Delivery, dl.DeadLetter]]
    settled_keys: list[str]
    spans: list[trace.Span]  # the batch's store spans, linked to its deliveries' contexts; none if not recording


def end_spans(spans: Sequence[trace.Span], exc: BaseException | None = None) -> None:
    """End a batch's spans, marked failed by ``exc`` if given."""
    for span in spans:
        if exc is not None:
            tracing.failed(span, exc)
        span.end()


class Storing:
    """The receiver's database side (a part of the daemon class: the tests and the bench
    reach these methods on ``Receiver``)."""

    settings: Settings
    config: ReceiverConfig
    intake: Intake
    queue: str
    log: logs.Log
    _at: Store  # where the group being settled is written: the service's database, or its tenant's

    def _owner(self) -> dict[str, str]:
        """The labels of what the group being settled counts: its tenant's, if it has one."""
        return metrics.labels(self.settings.service, self._at.key)

    def _count_redeliveries(self, group: Sequence[Delivery]) -> dict[int, dl.DeadLetter]:
        """Count redeliveries in their own committed transaction; dead letters for those past the limit."""
        forced: dict[int, dl.DeadLetter] = {}
        redelivered = [d for d in group if d.redelivered]
        if not redelivered:
            return forced
        metrics.RECEIVER_REDELIVERED.labels(**self._owner()).inc(len(redelivered))
        conn = self._connection()
        with conn.cursor() as cur:
            counts = {
                d.delivery_tag: redeliveries_sql.count(cur, self._at.schema, self.queue, d.counter_key)
                for d in redelivered
            }
        conn.commit()
        for delivery in redelivered:
            count = counts[delivery.delivery_tag]
            if count > self.config.redelivery_limit:
                forced[delivery.delivery_tag] = self._redelivery_letter(delivery, count)
        return forced

    def _redelivery_letter(self, delivery: Delivery, count: int) -> dl.DeadLetter:
        error = (
            f"redelivered {count} times (limit {self.config.redelivery_limit}): the receiver died holding it each time"
        )
        return self._letter(delivery, Reason.REDELIVERY_LIMIT, error)

    def _letter(self, delivery: Delivery, reason: str, error: str) -> dl.DeadLetter:
        """A ``reason`` letter of ``delivery`` decided before its body was judged: the message
        kept when it is JSON, the raw body either way."""
        try:
            data: Any = decode_json(delivery.body)
        except Exception:  # whatever it is, it is dead: keep the raw body only
            data = None
        try:
            return self.intake.reject(delivery, reason, error, data=data)
        except Exception:  # last resort: a letter from the raw delivery alone
            letter = self.intake.last_resort(delivery, error)
            letter.reason = letter.error_type = reason
            return letter

    def _store(self, group: Sequence[Delivery], forced: dict[int, dl.DeadLetter]) -> None:
        self._write(self._admit(group, forced))

    def _admit(self, group: Sequence[Delivery], forced: dict[int, dl.DeadLetter]) -> Prepared:
        """Parse and validate (CPU only, no database): rows to store and dead letters."""
        pairs: list[tuple[Delivery, InboxRow]] = []
        letters: list[tuple[Delivery, dl.DeadLetter]] = []
        for delivery in group:
            # The sender's context, bounded, is what the handler continues (the worker
            # parses it) and what the store spans link (docs/explanation/operations.md, "Tracing").
            delivery.trace = tracing.carrier_from(delivery.headers) or None
        spans = self._store_spans(group)
        try:
            for delivery in group:
                outcome = forced.get(delivery.delivery_tag) or self.intake.admit(delivery)
                if isinstance(outcome, InboxRow):
                    pairs.append((delivery, outcome))
                elif isinstance(outcome, Filtered):
                    # Not for this service: acked with its batch, never stored (docs/explanation/receive.md,
                    # "Expiry and filters").
                    metrics.RECEIVER_FILTERED.labels(message_type=outcome.message_type, **self._owner()).inc()
                else:
                    letters.append((delivery, outcome))
        except BaseException as exc:
            end_spans(spans, exc)
            raise
        if letters:
            for span in spans:
                span.set_attribute("txbox.rejected", len(letters))
        return Prepared(pairs, letters, [d.counter_key for d in group if d.redelivered], spans)

    def _store_spans(self, group: Sequence[Delivery]) -> list[trace.Span]:
        """The CONSUMER spans of one batch (parsing and its one write), linked to the context
        of every delivery, ours or a foreign publisher's (docs/explanation/operations.md, "Tracing")."""
        return tracing.batch_spans(
            f"store {self.queue}",
            trace.SpanKind.CONSUMER,
            {
                "messaging.system": tracing.MESSAGING_SYSTEM,
                "messaging.operation.type": "receive",
                "messaging.destination.name": self.queue,
                "messaging.batch.message_count": len(group),
            },
            (delivery.trace for delivery in group),
        )

    def _write(self, prepared: Prepared) -> None:
        """One statement for the rows, one for the dead letters, one for the counters; one commit.

        A message id that was already stored is compared with what is stored only then
        (one more statement, for those ids alone): a true duplicate is quiet, a different
        message under that id is an ``id_conflict`` letter.
        """
        if not prepared.spans:
            self._write_batch(prepared)
            return
        try:
            with trace.use_span(prepared.spans[0], record_exception=False, set_status_on_exception=False):
                self._write_batch(prepared)
        except BaseException as exc:
            end_spans(prepared.spans, exc)
            raise
        end_spans(prepared.spans)

    def _write_batch(self, prepared: Prepared) -> None:
        pairs, settled_keys = prepared.pairs, prepared.settled_keys
        rows = [row for _, row in pairs]
        schema = self._at.schema
        conn = self._connection()
        try:
            with conn.cursor() as cur:
                new = inbox_sql.insert_rows(cur, schema, rows)
                letters = prepared.letters + self._conflicts(cur, pairs, new)
                dead_letters_sql.insert_letters(cur, schema, [letter for _, letter in letters])
                redeliveries_sql.forget(cur, schema, self.queue, settled_keys)
            conn.commit()
        except Exception as exc:  # psycopg's, or a dead letter that cannot be built
            conn.rollback()
            if db.is_infrastructure_error(exc):
                raise
            # Something in the data (e.g. \u0000 inside a JSON string, which jsonb
            # refuses): find the culprits one savepoint at a time.
            new, letters = self._store_carefully(conn, prepared)
        self._count(rows, new, [letter for _, letter in letters])

    def _conflicts(
        self, cur: psycopg.Cursor[Any], pairs: Sequence[tuple[Delivery, InboxRow]], new: set[Any]
    ) -> list[tuple[Delivery, dl.DeadLetter]]:
        """``id_conflict`` letters for the rows whose id the inbox holds with other content."""
        rows = [row for _, row in pairs]
        letters = []
        for index, stored in inbox_sql.conflicting(cur, self._at.schema, rows, new):
            delivery, row = pairs[index]
            try:
                data: Any = decode_json(delivery.body)
            except Exception:
                data = None
            letter = self.intake.reject(
                delivery,
                Reason.ID_CONFLICT,
                f"message id {row.id} is already in the inbox with other content ({stored}): "
                "a different message reusing an id is not a duplicate",
                data=data,
            )
            letter.message_id, letter.message_type = row.id, row.message_type
            letters.append((delivery, letter))
        return letters

    def _store_carefully(
        self, conn: psycopg.Connection[Any], prepared: Prepared
    ) -> tuple[set[Any], list[tuple[Delivery, dl.DeadLetter]]]:
        """Each row, then each dead letter, in a savepoint of its own: one bad item cannot fail the rest."""
        schema = self._at.schema
        new: set[Any] = set()
        letters = list(prepared.letters)
        kept: list[tuple[Delivery, InboxRow]] = []
        with conn.cursor() as cur:
            for delivery, row in prepared.pairs:
                try:
                    with conn.transaction():
                        new |= inbox_sql.insert_rows(cur, schema, [row])
                    kept.append((delivery, row))
                except Exception as exc:
                    if db.is_infrastructure_error(exc):
                        raise
                    letter = self.intake.reject(
                        delivery,
                        Reason.UNSTORABLE,
                        f"PostgreSQL refused the row: {exc}".strip(),
                        error_type=type(exc).__name__,
                    )
                    letter.message_id, letter.message_type = row.id, row.message_type
                    letters.append((delivery, letter))
            letters += self._conflicts(cur, kept, new)
            letters = [(delivery, self._insert_letter(conn, cur, delivery, letter)) for delivery, letter in letters]
            redeliveries_sql.forget(cur, schema, self.queue, prepared.settled_keys)
        conn.commit()
        return new, letters

    def _insert_letter(
        self, conn: psycopg.Connection[Any], cur: psycopg.Cursor[Any], delivery: Delivery, letter: dl.DeadLetter
    ) -> dl.DeadLetter:
        """Store ``letter``; if it cannot be, an ``internal_error`` letter of the raw delivery instead."""
        try:
            with conn.transaction():
                dead_letters_sql.insert_letters(cur, self._at.schema, [letter])
            return letter
        except Exception as exc:
            if db.is_infrastructure_error(exc):
                raise
            fallback = self.intake.last_resort(delivery, f"the {letter.reason} dead letter could not be stored: {exc}")
            with conn.transaction():
                dead_letters_sql.insert_letters(cur, self._at.schema, [fallback])
            return fallback

    def _count(self, rows: Sequence[InboxRow], new: set[Any], letters: Sequence[dl.DeadLetter]) -> None:
        metrics.RECEIVER_STORED.labels(**self._owner()).inc(len(new))
        conflicts = sum(1 for letter in letters if letter.reason == Reason.ID_CONFLICT)
        if len(rows) > len(new) + conflicts:
            metrics.RECEIVER_DUPLICATES.labels(**self._owner()).inc(len(rows) - len(new) - conflicts)
        if conflicts:
            metrics.RECEIVER_ID_CONFLICTS.labels(**self._owner()).inc(conflicts)
        for letter in letters:
            metrics.RECEIVER_REJECTED.labels(reason=letter.reason, **self._owner()).inc()
            if letter.reason != Reason.UNSTORABLE:
                self.log.warning("rejected a delivery (%s): %s", letter.reason, letter.error[:300])

    # --- last resort: the settling itself failed ----------------------------------------

    # --- PostgreSQL connection ----------------------------------------------------

    def _connection(self) -> psycopg.Connection[Any]:
        return self._at.slot.get()

    def _drop_db(self) -> None:
        self._at.close()
