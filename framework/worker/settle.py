"""Settling a batch's claims: what a handler's outcome means for its row, and the statements
that record it (docs/explanation/handle.md, "Worker batches").

:class:`Settlement` classifies a failed run (retry with backoff, or abandon: a
``PermanentError``, the last attempt), abandons rows for the worker's own reasons
(poison, expiry, no handler, unreadable), writes every outcome other than *processed*
in the batch's transaction (the presumption already marked the rest) with the dead
letters of the abandoned rows, gives claims back unrun, and counts the outcomes in the
metrics and the log. It runs no handler and opens no transaction of its own, except
:meth:`Settlement.release`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
from sqlalchemy import Connection

from framework import dead_letters as dl
from framework import jsoncodec, logs, metrics, redaction
from framework.backoff import backoff_seconds
from framework.errors import PermanentError
from framework.outcomes import WorkerOutcome
from framework.reasons import Reason
from framework.sql import dead_letters as dead_letters_sql
from framework.sql import inbox as inbox_sql
from framework.worker.config import WorkerConfig
from framework.worker.decode import Claimed, describe


def driver(conn: Connection) -> psycopg.Connection[Any]:
    """The psycopg connection under a SQLAlchemy one."""
    raw: psycopg.Connection[Any] = conn.connection.driver_connection  # type: ignore[assignment]
    return raw


def abandon(claimed: Claimed, reason: str, error: str, *, error_type: str = "", finished_delta: int = 1) -> None:
    """Give ``claimed`` up into the dead letters, for ``reason``."""
    claimed.outcome = WorkerOutcome.ABANDONED
    claimed.reason = reason
    claimed.error = error
    claimed.error_type = error_type or reason
    claimed.finished_delta = finished_delta


def clip(text: str, limit: int = 2000) -> str:
    """Error text for ``last_error``: bounded, and without what a text column refuses."""
    text = jsoncodec.clean_string(text)
    return text if len(text) <= limit else text[:limit] + "…"


class Settlement:
    """The outcomes of one worker's claims, and their statements."""

    def __init__(self, schema: str, config: WorkerConfig, labels: dict[str, str], log: logs.Log) -> None:
        self.schema = schema
        self.config = config
        self._labels = labels
        self.log = log

    def classify(self, claimed: Claimed, exc: BaseException) -> None:
        """What a handler's exception means: abandoned now, or failed and retried after a backoff."""
        # A handler's error text is logged and stored (last_error, the dead letter): never
        # with the message's auth_token in it (docs/explanation/operations.md, "Secrets").
        token = claimed.message.auth_token
        text = redaction.scrub_values(redaction.redact_text(describe(exc)), [token] if token else [])
        if isinstance(exc, PermanentError):
            abandon(claimed, exc.dead_letter_reason, text, error_type=type(exc).__name__)
            return
        if claimed.message.is_final_attempt:
            abandon(
                claimed,
                Reason.MAX_ATTEMPTS,
                f"failed {claimed.message.attempt} of {claimed.message.max_attempts} attempts; last: {text}",
                error_type=type(exc).__name__,
            )
            return
        claimed.outcome = WorkerOutcome.FAILED
        claimed.error = text
        claimed.error_type = type(exc).__name__
        claimed.delay = backoff_seconds(
            claimed.message.attempt,
            base=float(self.config.backoff_base),
            cap=float(self.config.backoff_cap),
            jitter=self.config.backoff_jitter,
        )

    def write(self, cur: psycopg.Cursor[Any], batch: Sequence[Claimed], *, bare: bool = False) -> None:
        """Write every outcome of the batch in the processing transaction."""
        # Processed rows are already marked (presume_processed); correct the others.
        failed = [c for c in batch if c.outcome is WorkerOutcome.FAILED]
        if failed:
            cur.executemany(
                inbox_sql.mark_failed(self.schema),
                [
                    {
                        "id": c.id,
                        "delay": c.delay,
                        "error": clip(f"{c.error_type}: {c.error}"),
                        "auth_token": c.metadata.get("auth_token"),
                    }
                    for c in failed
                ],
            )
        abandoned = [c for c in batch if c.outcome is WorkerOutcome.ABANDONED]
        released = [c for c in batch if c.outcome is WorkerOutcome.RELEASED]
        if released:
            cur.execute(
                inbox_sql.unclaim(self.schema),
                ([c.id for c in released], [c.metadata.get("auth_token") for c in released]),
            )
        if abandoned:
            cur.executemany(
                inbox_sql.mark_abandoned(self.schema),
                [
                    {"id": c.id, "finished": c.finished_delta, "error": clip(f"{c.reason}: {c.error}")}
                    for c in abandoned
                ],
            )
            dead_letters_sql.insert_letters(cur, self.schema, [self.dead_letter(c, bare=bare) for c in abandoned])

    def dead_letter(self, claimed: Claimed, *, bare: bool = False) -> dl.DeadLetter:
        """The dead letter of an abandoned claim; ``bare``: only what cannot fail to store."""
        if bare:
            return dl.DeadLetter(
                source="inbox",
                reason=claimed.reason,
                error=claimed.error,
                error_type=claimed.error_type,
                message_id=claimed.id,
            )
        properties = claimed.metadata.get("properties")
        headers = properties.get("headers") if isinstance(properties, dict) else None
        return dl.DeadLetter(
            source="inbox",
            reason=claimed.reason,
            error=claimed.error,
            error_type=claimed.error_type,
            message_id=claimed.id,
            message_type=claimed.message_type,
            routing_key=claimed.routing_key,
            message=claimed.message.to_dict() if claimed.raw is None else None,
            raw_body=jsoncodec.dumps(claimed.raw).encode() if claimed.raw is not None else None,
            headers=headers if isinstance(headers, dict) else {},
            attempts={
                "started": claimed.started,
                "finished": claimed.finished + claimed.finished_delta,
                "max_attempts": claimed.message.max_attempts,
            },
        )

    def count(self, batch: Sequence[Claimed], processed: Any) -> None:
        """Metrics and log lines of a settled batch; ``processed(message_type)`` is the counter child."""
        for c in batch:
            if c.outcome is WorkerOutcome.PROCESSED:
                processed(c.message_type).inc()
                continue
            labels = {"message_type": c.message_type, **self._labels}
            if c.outcome is WorkerOutcome.FAILED:
                metrics.WORKER_FAILED.labels(**labels).inc()
                self.log.warning("%s %s failed (attempt %d): %s", c.message_type, c.id, c.message.attempt, c.error)
            elif c.outcome is WorkerOutcome.ABANDONED:
                metrics.WORKER_ABANDONED.labels(reason=c.reason, **labels).inc()
                self.log.error("%s %s abandoned (%s): %s", c.message_type, c.id, c.reason, c.error)

    def release(self, conn: Connection, batch: Sequence[Claimed]) -> None:
        """Give back claims that were never run: not an attempt, not poison."""
        with conn.begin():
            driver(conn).cursor().execute(
                inbox_sql.release(self.schema), {"ids": [c.id for c in batch], "started": [c.started for c in batch]}
            )
