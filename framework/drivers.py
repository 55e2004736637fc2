"""Driver tuning the daemons need, applied when a daemon starts, never when txbox is imported.

The changes are process-wide (they replace a function of pika, raise two limits of
psycopg and freeze the heap for the garbage collector), so an application that merely
imports txbox to write outbox rows must not get them behind its back
(docs/architecture.md, "What txbox changes in a process"). Every daemon calls
:func:`tune_drivers` in its constructor, so a daemon run by the CLI, by ``txbox run`` or
embedded in a test has them before its first connection.
"""

from __future__ import annotations

import gc
import threading

from framework import amqp, db

_lock = threading.Lock()
_tuned = False


def tune_drivers() -> None:
    """Bound pika's header-table decoding depth, widen psycopg's statement cache and freeze
    the heap built so far for the garbage collector; idempotent."""
    global _tuned
    with _lock:
        if _tuned:
            return
        amqp.bound_decoder_depth()
        db.widen_statement_cache()
        _freeze_heap()
        _tuned = True


def _freeze_heap() -> None:
    """Move every object alive now (the imported modules, the service, its contracts) out
    of the garbage collector's reach.

    A daemon allocates per message (rows, messages, spans waiting for export) and the
    collector's full passes walked the hundreds of thousands of objects the imports left,
    every time: ``gc.freeze()`` took 14 % of the worker's CPU per message off
    (docs/architecture.md, "What txbox changes in a process"). What is frozen is never
    freed, so this runs once, before the daemon's first message.
    """
    gc.collect()
    gc.freeze()
