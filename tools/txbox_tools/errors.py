"""The development tools' own failures, under the library's one root (``TxboxError``).

They are here, not in ``framework/errors.py``, because nothing in the wheel raises them
(docs/explanation/development.md, "The development tools").
"""

from __future__ import annotations

from framework.errors import TxboxError


class InstanceError(TxboxError):
    """A private PostgreSQL or RabbitMQ (benchmarks, chaos runs) could not be created, started or stopped."""


class ChaosFailed(TxboxError):
    """The chaos run could not finish (stalled, could not start): no verdict possible."""
