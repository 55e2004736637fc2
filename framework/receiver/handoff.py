"""The receiver's side of the hand-off to the worker of its own process (`txbox run`).

docs/explanation/daemons.md, "The hand-off in one process": while the worker can take
more (:attr:`framework.worker.Worker.wants_handoff`), a batch's INSERT goes out with two
more statements in the same pipeline, so in the same round trip and transaction: first
the setting that leaves the insert's NOTIFY out (migration 0011), then the worker's own
claim of the batch's ids (:func:`framework.sql.inbox.claim_ids`, with the worker's lease).
Once the batch is committed, the claimed rows go to :meth:`framework.worker.Worker.take`
on the loop both daemons run on. Everything here runs on that loop's thread.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

from psycopg import pq
from psycopg.abc import AdaptContext

from framework import names
from framework.receiver.write import Step
from framework.sql import inbox as inbox_sql
from framework.sql import positional, rendered
from framework.worker import decode

if TYPE_CHECKING:
    from framework.worker import Worker

_QUIET = b"txbox_receiver_quiet"
_CLAIM = b"txbox_receiver_claim"


class Handoff:
    """Claims what the receiver stores for ``worker``, in the storing transaction."""

    def __init__(self, worker: Worker) -> None:
        self._worker = worker
        self._lease = str(float(worker.config.lease)).encode()
        self._quiet = Step(_QUIET, b"SELECT set_config($1, 'off', true)", [names.QUIET_NOTIFY_SETTING.encode()])
        claim = inbox_sql.claim_ids(worker.schema, park=worker.config.segment_policy == "park")
        self._claim = positional(rendered(claim), ("ids", "lease"), {"lease": "float8"})

    @property
    def wanted(self) -> bool:
        """The worker would take rows now: hand this batch over."""
        return self._worker.wants_handoff

    def steps(self, insert: Step, ids: Sequence[uuid.UUID]) -> list[Step]:
        """``insert`` with the hand-off's statements around it: the quiet setting before, the
        claim of ``ids`` after (its result is the last)."""
        literal = ("{" + ",".join(map(str, ids)) + "}").encode()
        return [self._quiet, insert, Step(_CLAIM, self._claim, [literal, self._lease])]

    def deliver(self, claimed_at: float, claim: pq.abc.PGresult, context: AdaptContext) -> None:
        """The batch is committed: hand the rows ``claim`` returned (received on a connection
        of ``context``) to the worker, their lease begun at ``claimed_at`` (monotonic)."""
        self._worker.take(claimed_at, decode.claim_rows(claim, context), statements=1)  # and the quiet setting
