"""What the worker sends to PostgreSQL, counted on its own thread (docs/explanation/handle.md, "Worker batches").

Every statement of a claim, a batch (BEGIN and COMMIT included: psycopg sends them as
statements of their own) and the handlers' own queries adds to :class:`Counts`, which the
worker's loop alone writes and which feeds ``txbox_worker_statements_total`` and
``txbox_worker_claims_total``. ``txbox bench worker`` and ``txbox bench latency`` read
them as statements per message. A handler's statements reach PostgreSQL through the
processing connection's cursors, so that connection gets :func:`counting_cursor`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import psycopg

from framework import metrics


@dataclass
class Counts:
    """Running totals of one worker; ``statements`` includes the claims'."""

    claims: int = 0
    empty_claims: int = 0
    statements: int = 0
    handed: int = 0  # rows another daemon of the process claimed for this worker (Worker.take)
    _published: int = 0  # statements already added to the metric

    def claim(self, rows: int, labels: dict[str, str]) -> None:
        self.claims += 1
        self.statements += 1
        if not rows:
            self.empty_claims += 1
        metrics.WORKER_CLAIMS.labels(found="rows" if rows else "nothing", **labels).inc()

    def publish(self, labels: dict[str, str]) -> None:
        """Add the statements since the last call to the metric (once per batch, not per statement)."""
        delta, self._published = self.statements - self._published, self.statements
        if delta:
            metrics.WORKER_STATEMENTS.labels(**labels).inc(delta)

    def as_dict(self) -> dict[str, int]:
        return {
            "claims": self.claims,
            "empty_claims": self.empty_claims,
            "statements": self.statements,
            "handed": self.handed,
        }


def counting_cursor(counts: Counts) -> type[psycopg.Cursor[Any]]:
    """A cursor class that adds each statement it sends to ``counts`` (``executemany``: one per row)."""

    class CountingCursor(psycopg.Cursor[Any]):
        def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
            counts.statements += 1
            return super().execute(query, params, **kwargs)

        def executemany(self, query: Any, params_seq: Iterable[Any], **kwargs: Any) -> None:
            params = params_seq if isinstance(params_seq, list | tuple) else list(params_seq)
            counts.statements += len(params)
            super().executemany(query, params, **kwargs)

    return CountingCursor
