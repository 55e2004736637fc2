"""Every reason code a dead letter can carry, in one place.

The values are stored in ``txbox.dead_letters.reason``, shown by ``txbox dlq`` and the
dashboard, used as a metric label and read by code outside txbox: never change a
spelling, only add members (docs/explanation/dead-letters.md, "Dead letters"). A ``StrEnum`` member
is its string everywhere it goes (psycopg, JSON, pika headers, Prometheus labels).

Two kinds of reason are not members: what RabbitMQ itself dead-lettered is
``broker_<its reason>`` (:func:`broker`), and a collector keeps the reason header of our
own daemons' copies as it reads it.
"""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    # The body is not a valid envelope (framework.envelope raises EnvelopeError with these).
    EMPTY_BODY = "empty_body"
    NOT_UTF8 = "not_utf8"
    NOT_JSON = "not_json"
    TOO_DEEP = "too_deep"
    NOT_OBJECT = "not_object"
    MISSING_FIELD = "missing_field"
    INVALID_FIELD = "invalid_field"
    # The receiver refused a well-formed envelope (docs/explanation/receive.md, "Receiver intake").
    UNKNOWN_MESSAGE_TYPE = "unknown_message_type"
    SCHEMA_INVALID = "schema_invalid"
    TOO_LARGE = "too_large"
    WRONG_CONTENT_TYPE = "wrong_content_type"
    NOT_ACCEPTED = "not_accepted"  # a known type this service neither accepts nor subscribes to
    WRONG_ROUTE = "wrong_route"  # the message came by another route than its contract gives it
    ID_CONFLICT = "id_conflict"  # the inbox holds this message id with other content
    UNSTORABLE = "unstorable"  # PostgreSQL refused the row for a reason of the data (e.g. \u0000 in JSON)
    REDELIVERY_LIMIT = "redelivery_limit"
    RETRIES_EXHAUSTED = "retries_exhausted"  # the broker-level delay/retry chain used up
    # A receiver serving tenants: the delivery names none of the registry's (docs/how-to/tenants.md).
    UNKNOWN_TENANT = "unknown_tenant"
    # The worker gave up (docs/explanation/handle.md, "Outcomes").
    MAX_ATTEMPTS = "max_attempts"  # also the relay's: publishing failed that often
    PERMANENT_ERROR = "permanent_error"
    POISON = "poison"
    NO_HANDLER = "no_handler"  # a message type this process has no handler for
    UNAUTHORIZED = "unauthorized"  # auth_token missing, invalid or short of the handler's permissions
    # An event's signature did not pass its producer's policy (docs/explanation/receive.md, "Event signing").
    SIGNATURE_MISSING = "signature_missing"
    SIGNATURE_INVALID = "signature_invalid"
    SIGNING_KEY_UNKNOWN = "signing_key_unknown"
    # The relay gave up: the broker's answer to a publish (also PublishError.reason).
    UNROUTABLE = "unroutable"
    NACKED = "nacked"
    # The message's time to live ran out before it was handled, wherever it waited
    # (docs/explanation/receive.md, "Expiry and filters").
    EXPIRED = "expired"
    # The last resort: txbox failed to judge or store the input; what could be kept is kept.
    INTERNAL_ERROR = "internal_error"


def broker(reason: str | None) -> str:
    """The reason of a message RabbitMQ dead-lettered itself (``rejected``, ``expired``…)."""
    return f"broker_{reason or 'unknown'}"
