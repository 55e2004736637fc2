"""The relay's translation: an outbox row as claimed → the AMQP message it is sent as.

Pure functions of the row (and the relay's broker user and signer): no I/O, no state.
The daemon (framework/relay/daemon.py) publishes what these build; settlement
(framework/relay/settle.py) records what became of it.
"""

from __future__ import annotations

import json
from typing import Any

import pika

from framework import expiry, names, tracing
from framework.confirms.channel import Outgoing
from framework.envelope import CONTENT_TYPE
from framework.errors import PublishError
from framework.outbox import default_segment
from framework.reasons import Reason
from framework.redaction import clip
from framework.signing import Signer
from framework.sql.outbox import Claimed

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def envelope_body(row: Claimed) -> bytes:
    """The envelope, assembled from the row's JSON text without parsing it again.

    Payload and context come out of PostgreSQL as JSON text already; splicing them saves
    a parse and a dump per message on the hot path. Field order is the envelope's
    (docs/explanation/relay.md, "The envelope").
    """
    parts = [
        '{"payload":',
        row.payload_json,
        ',"message_context":',
        row.context_json,
        ',"message_id":"',
        row.id,
        '","timestamp":"',
        row.stamp,
        '","message_type":',
        _dumps(row.message_type),
        ',"aggregate_id":',
        _dumps(row.aggregate_id),
        ',"aggregate_type":',
        _dumps(row.aggregate_type),
        ',"message_version":',
        _dumps(row.message_version),
    ]
    if row.auth_token is not None:
        parts += [',"auth_token":', _dumps(row.auth_token)]
    parts.append("}")
    return "".join(parts).encode()


_SHORT_BYTES = 255  # an AMQP short string (the ``type`` property, a routing key)
_SHORT_CHARS = _SHORT_BYTES // 4


def _short_strings(row: Claimed) -> None:
    """Raise if a value sent as an AMQP short string is longer than one holds."""
    for name, value in (("message_type", row.message_type), ("routing_key", row.routing_key)):
        if len(value.encode()) > _SHORT_BYTES:
            raise ValueError(f"{name} of {len(value.encode())} bytes: AMQP allows {_SHORT_BYTES}")


def unbuildable(row: Claimed, exc: Exception) -> tuple[Outgoing, PublishError]:
    """The outcome of a row whose message could not be built: a failure the writer abandons
    at once as ``internal_error`` (docs/explanation/dead-letters.md, "Dead letters")."""
    item = Outgoing("", "", b"", pika.BasicProperties(message_id=row.id), True, row)
    error = f"the relay could not build its message: {type(exc).__name__}: {exc}"
    return item, PublishError(clip(error, 2000) or "", Reason.INTERNAL_ERROR)  # clip: see redaction.clip


def lane_headers(row: Claimed) -> dict[str, Any]:
    """The ordering lane the sender chose, for the receiving service's inbox row.

    Only what differs from the receiver's defaults is sent (the usual message, one lane
    per aggregate at priority 0, carries none of it). The priority travels as a header
    because the row's is a smallint and the AMQP property holds 0-255 only; receivers
    honour these headers from trusted broker users only (the ``user_id`` property).
    """
    headers: dict[str, Any] = {}
    if row.segment and row.segment != default_segment(row.aggregate_type, row.aggregate_id):
        headers[names.HEADER_SEGMENT] = row.segment
    if row.concurrency == "parallel":
        headers[names.HEADER_CONCURRENCY] = row.concurrency
    if row.priority:
        headers[names.HEADER_PRIORITY] = row.priority
    return headers


def outgoing(row: Claimed, user_id: str = "", signer: Signer | None = None, tenant: str | None = None) -> Outgoing:
    """The AMQP message of a row: persistent, mandatory, properties mirroring the envelope.

    ``tenant``: the registry key of the tenant whose outbox the row is in, sent as the
    ``x-txbox-tenant`` header, by which a receiver serving tenants stores it in its
    tenant's inbox (docs/how-to/tenants.md, "One set of daemons for every tenant").

    ``user_id`` (the relay's broker user) lets RabbitMQ vouch for the lane headers. The
    AMQP ``priority`` mirrors the row's where it fits 0-255 (classic priority queues
    and other consumers read it; quorum queues ignore it). With a ``signer``, an event
    carries the signature of its body, as Mosaic's do (docs/explanation/receive.md, "Event
    signing"); commands are not signed.
    """
    body = envelope_body(row)
    headers = lane_headers(row)
    if signer is not None and row.kind == "event":
        headers.update(signer.headers(body))
    if row.correlation_id:
        headers[names.HEADER_CORRELATION_ID] = row.correlation_id
    if tenant is not None:
        headers[names.HEADER_TENANT] = tenant
    if row.expires_at is not None:
        expires_at = expiry.from_metadata(row.expires_at)
        if expires_at is not None:
            headers[names.HEADER_EXPIRES_AT] = expiry.header_value(expires_at)
    # The writer's context goes out as it was stored: the publish is a batch span linked
    # to it, not a hop of the trace (docs/explanation/operations.md, "Tracing").
    if row.trace is not None:
        headers.update(tracing.carrier_from(row.trace))
    # AMQP short strings hold 255 bytes: pika would refuse them only when publishing, on
    # the I/O thread, as a lost connection, and the row would be released and claimed
    # again forever. Text is at most 4 bytes a character: most values skip the encoding.
    if len(row.message_type) > _SHORT_CHARS or len(row.routing_key) > _SHORT_CHARS:
        _short_strings(row)
    props = pika.BasicProperties(
        content_type=CONTENT_TYPE,
        delivery_mode=2,
        message_id=row.id,
        type=row.message_type,
        timestamp=row.epoch,
        headers=headers or None,
        priority=row.priority if 0 < row.priority <= 255 else None,
        user_id=user_id or None,
    )
    return Outgoing(names.exchange_for(row.kind), row.routing_key, body, props, True, row)
