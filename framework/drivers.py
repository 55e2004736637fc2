"""Driver tuning the daemons need, applied when a daemon starts, never when txbox is imported.

The changes are process-wide (they replace a function of pika, raise two limits of
psycopg, freeze the heap for the garbage collector and space out its young
collections), so an application that merely
imports txbox to write outbox rows must not get them behind its back
(docs/explanation/daemons.md, "What txbox changes in a process"). Every daemon calls
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
    """Bound pika's header-table decoding depth, widen psycopg's statement cache, freeze
    the heap built so far for the garbage collector and space out its young collections;
    idempotent."""
    global _tuned
    with _lock:
        if _tuned:
            return
        amqp.bound_decoder_depth()
        db.widen_statement_cache()
        _freeze_heap()
        _space_young_collections()
        _tuned = True


def _freeze_heap() -> None:
    """Move every object alive now (the imported modules, the service, its contracts) out
    of the garbage collector's reach.

    A daemon allocates per message (rows, messages, spans waiting for export) and the
    collector's full passes walked the hundreds of thousands of objects the imports left,
    every time: ``gc.freeze()`` takes that walk off every message's CPU
    (docs/explanation/daemons.md, "What txbox changes in a process"). What is frozen is never
    freed, so this runs once, before the daemon's first message.
    """
    gc.collect()
    gc.freeze()


# The interpreter's default: a young collection after 700 more container objects were
# made than freed.
_DEFAULT_YOUNG = 700
YOUNG_THRESHOLD = 20_000


def _space_young_collections() -> None:
    """Collect the youngest generation after :data:`YOUNG_THRESHOLD` allocations instead of
    700, unless the application chose its own thresholds.

    A daemon holds a batch's rows, messages, ORM objects and spans (those the span
    processor keeps until it exports 512 of them) for longer than 700 allocations: each
    young collection found them alive, walked them and moved them up, and the older
    collections walked them again; spaced out, they cost a worker far less of its CPU
    (docs/explanation/daemons.md, "What txbox changes in a process"). Garbage in reference cycles
    waits longer: :data:`YOUNG_THRESHOLD` objects at most.
    """
    young, older, oldest = gc.get_threshold()
    if young == _DEFAULT_YOUNG:
        gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
