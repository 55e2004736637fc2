"""The relay's settlement: what became of each publish, written to the outbox.

Outcomes of one publish (framework/relay/daemon.py has the whole list):

- confirmed → published (the mark usually rides the next claim: framework/sql/outbox.py);
- returned unroutable: a command is a failure (nobody accepts it: likely a missing
  binding), an event is published (nobody subscribed);
- nacked / unroutable command / confirm timeout → ``finished_attempts + 1``, backoff via
  ``locked_until``; after ``max_attempts`` abandoned with a dead letter, in one transaction;
- not built or expired before it was sent → abandoned at once with its dead letter;
- connection lost / publisher closed → the lease is released at once (no attempt is
  counted: it was not the message's fault; the broker may have it, the inbox dedups).

:class:`Settlement` holds the statements and runs them on the connection it is given,
on the relay's loop thread; it keeps no state between calls.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter as Tally
from dataclasses import dataclass, field
from typing import Any

import psycopg

from framework import logs, names
from framework.backoff import backoff_seconds
from framework.confirms.channel import TIMEOUT, Outgoing
from framework.dead_letters import DeadLetter
from framework.errors import PublishError
from framework.outcomes import RelayOutcome
from framework.reasons import Reason
from framework.relay.config import RelayConfig
from framework.relay.messages import envelope_body
from framework.sql import dead_letters as dead_letters_sql
from framework.sql import outbox as outbox_sql
from framework.sql import rendered
from framework.sql.outbox import Claimed


def relay_outcome(row: Claimed, error: PublishError | None) -> RelayOutcome:
    """What one publish's result means for its row (the list at the top of this module)."""
    if error is None or (error.reason == Reason.UNROUTABLE and row.kind == "event"):
        return RelayOutcome.PUBLISHED  # an event nobody subscribed to is fine
    if error.reason in (Reason.NACKED, Reason.UNROUTABLE, TIMEOUT, Reason.EXPIRED, Reason.INTERNAL_ERROR):
        return RelayOutcome.FAILED
    return RelayOutcome.RELEASED  # connection lost / publisher closed: not the message's fault


@dataclass
class Written:
    """What one write recorded, by message type (for the metrics), and whether it may have
    made rows due (a successor of a marked row, a released or failed row's lane)."""

    published: Tally[str] = field(default_factory=Tally)
    failed: Tally[tuple[str, str]] = field(default_factory=Tally)
    abandoned: Tally[str] = field(default_factory=Tally)
    unblocked: bool = False


class Settlement:
    """The outbox statements of outcomes, rendered once for the relay's schema."""

    def __init__(self, schema: str, config: RelayConfig, log: logs.Log) -> None:
        self.config = config
        self.log = log  # the relay's (a tenant's names it)
        self._sql_mark = rendered(outbox_sql.mark_published(schema))
        self._sql_retry = rendered(outbox_sql.retry_later(schema))
        self._sql_abandon = rendered(outbox_sql.abandon(schema))
        self._sql_release = rendered(outbox_sql.release(schema))
        self._sql_dead = rendered(dead_letters_sql.insert_sql(schema))

    def release(self, conn: psycopg.Connection[Any], ids: list[str]) -> None:
        """Give the leases of ``ids`` back at once (nothing was sent)."""
        conn.execute(self._sql_release, {"ids": ids})

    def marks(self, conn: psycopg.Connection[Any], published: list[Outgoing]) -> Written:
        """Mark ``published`` alone: one statement, which in autocommit commits in the round
        trip that runs it."""
        written = Written()
        for item in published:
            written.published[item.token.message_type] += 1
        with conn.cursor() as cur:
            written.unblocked = self._mark(cur, [item.token.id for item in published])
        return written

    def write(
        self, conn: psycopg.Connection[Any], published: list[Outgoing], others: list[tuple[Outgoing, PublishError]]
    ) -> Written:
        """Every outcome of ``published`` and ``others`` (failures and releases) in one transaction."""
        written = Written(unblocked=bool(others))
        released: list[str] = []
        failures: list[tuple[Claimed, PublishError]] = []
        marked = [item.token.id for item in published]
        for item in published:
            written.published[item.token.message_type] += 1
        for item, error in others:
            row: Claimed = item.token
            outcome = relay_outcome(row, error)
            if outcome is RelayOutcome.PUBLISHED:  # an unroutable event
                marked.append(row.id)
                written.published[row.message_type] += 1
            elif outcome is RelayOutcome.FAILED:
                failures.append((row, error))
            else:
                released.append(row.id)
        with conn.transaction(), conn.cursor() as cur:
            if marked:
                written.unblocked = self._mark(cur, marked) or written.unblocked
            if released:
                cur.execute(self._sql_release, {"ids": released})
            for row, error in failures:
                written.failed[(row.message_type, error.reason)] += 1
                if self._fail(cur, row, error):
                    written.abandoned[row.message_type] += 1
        if failures:
            self.log.warning("%d publish(es) failed, e.g. %s: %s", len(failures), failures[0][0].id, failures[0][1])
        return written

    def _mark(self, cur: psycopg.Cursor[Any], published: list[str]) -> bool:
        """Mark ``published``; True when that may have made rows due (see
        :func:`framework.sql.outbox.mark_published`)."""
        if not published:
            return False
        probe = len(published) <= outbox_sql.PROBE_AT_MOST
        cur.execute(self._sql_mark, {"ids": published, "probe": probe})
        return not probe or bool((cur.fetchone() or (False,))[0])

    def _fail(self, cur: psycopg.Cursor[Any], row: Claimed, error: PublishError) -> bool:
        """Count a failed attempt; abandon with a dead letter at ``max_attempts``. True if abandoned."""
        attempt = row.finished_attempts + 1
        text = str(error)
        if error.reason in (Reason.EXPIRED, Reason.INTERNAL_ERROR):  # no attempt would fare better
            return self._abandon(cur, row, error.reason, text, attempt)
        if attempt < self.config.max_attempts:
            config = self.config
            delay = backoff_seconds(attempt, base=config.retry_base, cap=config.retry_cap, jitter=0.5)
            cur.execute(self._sql_retry, {"id": row.id, "delay": delay, "error": text})
            return False
        reason = error.reason if error.reason in (Reason.NACKED, Reason.UNROUTABLE) else Reason.MAX_ATTEMPTS
        return self._abandon(cur, row, reason, f"gave up after {attempt} attempts: {text}", attempt)

    def _abandon(self, cur: psycopg.Cursor[Any], row: Claimed, reason: str, text: str, attempt: int) -> bool:
        """Give the row up with its dead letter. True if abandoned (False: finished elsewhere meanwhile)."""
        cur.execute(self._sql_abandon, {"id": row.id, "error": text})
        if cur.rowcount == 0:
            return False  # finished elsewhere meanwhile
        try:
            message: dict[str, Any] | None = json.loads(envelope_body(row))
        except Exception:  # the row's own columns stay in the outbox: the letter does without
            message = None
        letter = DeadLetter(
            source="outbox",
            reason=reason,
            error=text,
            error_type="PublishError",
            message_id=uuid.UUID(row.id),
            message_type=row.message_type,
            routing_key=row.routing_key,
            message=message,
            headers={"exchange": names.exchange_for(row.kind)},
            attempts={"started": row.started_attempts, "finished": attempt, "max_attempts": self.config.max_attempts},
        )
        cur.execute(self._sql_dead, letter.row())
        return True
