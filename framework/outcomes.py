"""What became of one message in a daemon, as enums rather than loose strings.

The values are the words the logs, metrics and docs use (docs/explanation/handle.md,
"Outcomes"); being ``StrEnum`` members they compare and format as those words.
"""

from __future__ import annotations

from enum import StrEnum


class RelayOutcome(StrEnum):
    """One publish of an outbox row, as the relay records it."""

    PUBLISHED = "published"  # confirmed (or an event nobody subscribed to): marked processed
    FAILED = "failed"  # nacked, a returned command, or no confirm in time: an attempt counted
    RELEASED = "released"  # the connection or publisher went away: lease given back, no attempt counted


class WorkerOutcome(StrEnum):
    """One claimed inbox row in the worker's batch."""

    PENDING = "pending"  # not settled yet in this pass
    PROCESSED = "processed"  # the handler returned: marked processed with its writes
    FAILED = "failed"  # the handler raised: due again after a backoff
    ABANDONED = "abandoned"  # given up: its dead letter is written in the same transaction
    RELEASED = "released"  # too little lease left to run it: given back unrun
    LOST = "lost"  # another worker claimed it after our lease ran out: nothing written
