"""Every error txbox raises derives from :class:`TxboxError`.

Driver errors (psycopg, pika, jsonschema, yaml) are converted to these at the adapter
boundary, so callers catch one root and branch on types that say what went wrong.

Two branches are control flow for handler authors rather than faults of txbox:
:class:`RetryableError` (settle as FAILED: retry later) and :class:`PermanentError`
(settle as REJECTED: straight to the dead letters), the outcomes of docs/explanation/handle.md, "Outcomes".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from framework.reasons import Reason


class TxboxError(Exception):
    """Root of every txbox error."""


class ConfigurationError(TxboxError):
    """A setting is missing or malformed; the message names it and shows a valid value."""


class TenantRegistryError(ConfigurationError):
    """The tenant registry (a file or the control table) does not load: ``problems`` names
    each entry at fault, where it is and the fix; ``source`` says which registry. Its text
    never holds a database password (docs/explanation/operations.md, "Tenants: the registry")."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        listed = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"the tenant registry {source} does not load:\n{listed}")


class SelectorError(ConfigurationError):
    """A handler's selector does not parse; the message names the handler, the position and
    what was expected there (docs/explanation/receive.md, "Expiry and filters")."""


class ContractError(TxboxError):
    """A contract file does not load, or a lookup in the registry failed."""


class UnknownMessageType(ContractError):
    """A message type that no loaded contract declares."""


class PayloadValidationError(TxboxError):
    """A payload does not satisfy its JSON Schema."""

    def __init__(self, message_type: str, errors: list[str]) -> None:
        self.message_type = message_type
        self.errors = errors
        super().__init__(f"payload of {message_type} is invalid: " + "; ".join(errors))


@dataclass(frozen=True)
class Problem:
    """One finding of the contracts lint or the assembly check."""

    severity: str  # "error" | "warning"
    where: str  # file and JSON path, or handler name
    message: str

    def __str__(self) -> str:
        return f"{self.severity}: {self.where}: {self.message}"


class AssemblyError(TxboxError):
    """`Service.check()` found a graph that does not fit: fail fast at start."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("the service does not assemble:\n" + "\n".join(f"  - {p}" for p in problems))


class EnvelopeError(TxboxError):
    """A message body is not a valid envelope.

    ``reason`` is a stable code used as the dead-letter reason; ``field`` names the
    envelope field at fault when there is one.
    """

    def __init__(self, reason: str, detail: str, field: str | None = None) -> None:
        self.reason = reason
        self.field = field
        self.detail = detail
        where = f" (field {field!r})" if field else ""
        super().__init__(f"{reason}{where}: {detail}")


class DatabaseUnavailable(TxboxError):
    """PostgreSQL could not be reached or dropped the connection (infrastructure, retry)."""


class BrokerUnavailable(TxboxError):
    """RabbitMQ could not be reached or dropped the connection (infrastructure, retry)."""


class TopologyMismatch(TxboxError):
    """A queue or exchange exists on the broker with different arguments."""


class PublishError(TxboxError):
    """A direct publish was not confirmed: nacked, returned as unroutable, or timed out.

    ``reason`` is a stable code: ``nacked``, ``unroutable``, ``timeout``,
    ``connection_lost`` or ``closed`` (the last two: the broker may or may not have it),
    or ``unencodable`` (raised by ``publish`` itself: nothing was sent).
    """

    def __init__(self, message: str, reason: str = "failed") -> None:
        self.reason = reason
        super().__init__(message)


class PublisherClosed(PublishError):
    """The publisher is closed or closing; nothing more may be sent through it."""


class PublisherOverflow(PublishError):
    """A direct send found ``max_unconfirmed`` sends awaiting their confirm: with overflow
    ``fail`` at once, with ``block`` after waiting ``overflow_timeout`` for room. Nothing was sent."""


class HandlerOutcome(TxboxError):
    """Base of the exceptions a handler raises to choose its settlement."""


class RetryableError(HandlerOutcome):
    """FAILED: roll back, retry after a backoff, abandon after ``max_attempts``."""


class PermanentError(HandlerOutcome):
    """REJECTED: roll back and abandon at once; the message goes to the dead letters."""

    #: The reason its dead letter carries (subclasses of txbox's own give a more precise one).
    dead_letter_reason: ClassVar[Reason] = Reason.PERMANENT_ERROR


class Unauthorized(PermanentError):
    """The message's ``auth_token`` is missing, invalid, expired, for another audience, or
    lacks a permission the handler requires (docs/explanation/handle.md, "Handler middleware and
    the permission guard"). Its text never contains the token."""

    dead_letter_reason = Reason.UNAUTHORIZED


class VersionNotHandled(PermanentError):
    """The handler neither takes the message's ``message_version`` nor has an upcaster for it."""


class DeadLetterUnstorable(DatabaseUnavailable):
    """PostgreSQL refused even the minimal row of a dead letter: the database is at fault,
    so the delivery is not acknowledged and is tried again once the database is fixed."""


class HandlerMisuse(RetryableError):
    """A handler ended, closed or broke the worker's transaction, or returned an awaitable:
    a failure of its message (retried, then abandoned), never of the worker."""


class DeliveryRejected(TxboxError):
    """``framework.testing``: the receiver would not store this message (its ``reason`` is
    the dead-letter reason the receiver would give, or ``filtered`` when its handler's
    selector does not match it), so no handler may run it."""

    def __init__(self, message: str, reason: str) -> None:
        self.reason = reason
        super().__init__(message)


class NotProcessed(TxboxError):
    """``framework.testing``: messages were not processed by the deadline, or were abandoned."""


class HandlerTimeout(RetryableError):
    """The handler ran longer than its timeout (counts as a failed attempt)."""


class ReplayRefused(TxboxError):
    """A letter that cannot be replayed as it is (no valid envelope, unknown type...)."""


class ArchiveError(TxboxError):
    """An archive batch could not be verified; nothing was deleted."""


class HttpError(TxboxError):
    """A dashboard request the dashboard answers with ``status`` and ``message`` (not a crash)."""

    def __init__(self, status: int, message: str) -> None:
        self.status = status
        self.message = message
        super().__init__(message)
