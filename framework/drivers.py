"""Driver tuning the daemons need, applied when a daemon starts, never when txbox is imported.

Both changes are process-wide (they replace a function of pika and raise two limits of
psycopg), so an application that merely imports txbox to write outbox rows must not get
them behind its back (docs/architecture.md, "What txbox changes in a process"). Every
daemon calls :func:`tune_drivers` in its constructor, so a daemon run by the CLI, by
``txbox run`` or embedded in a test has them before its first connection.
"""

from __future__ import annotations

import threading

from framework import amqp, db

_lock = threading.Lock()
_tuned = False


def tune_drivers() -> None:
    """Bound pika's header-table decoding depth and widen psycopg's statement cache; idempotent."""
    global _tuned
    with _lock:
        if _tuned:
            return
        amqp.bound_decoder_depth()
        db.widen_statement_cache()
        _tuned = True
