"""From a raw delivery to an inbox row or a rejection — pure, so every case is unit-tested.

Every malformation ends as a :class:`~framework.dead_letters.DeadLetter` with a stable
reason code and the raw body; nothing here raises for bad input (seed 001: REJECTED).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from framework import dead_letters as dl
from framework import jsoncodec, names
from framework.contracts import Registry
from framework.envelope import CONTENT_TYPE, decode_json, message_from_dict
from framework.errors import EnvelopeError, PayloadValidationError, UnknownMessageType
from framework.outbox import default_segment

NOT_ACCEPTED = "not_accepted"  # a known type this service neither accepts nor subscribes to
UNSTORABLE = "unstorable"  # PostgreSQL refused the row for a reason of the data (e.g. \u0000 in JSON)

_PROPERTY_NAMES = (
    "content_type",
    "content_encoding",
    "delivery_mode",
    "priority",
    "correlation_id",
    "reply_to",
    "expiration",
    "message_id",
    "timestamp",
    "type",
    "user_id",
    "app_id",
)


@dataclass(kw_only=True)
class Delivery:
    """One AMQP delivery as the receiver got it (decoupled from pika for tests)."""

    delivery_tag: int
    body: bytes
    redelivered: bool = False
    exchange: str = ""
    routing_key: str = ""
    properties: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_pika(cls, method: Any, props: Any, body: bytes) -> Delivery:
        properties = {name: getattr(props, name, None) for name in _PROPERTY_NAMES}
        return cls(
            delivery_tag=method.delivery_tag,
            body=body,
            redelivered=bool(method.redelivered),
            exchange=method.exchange or "",
            routing_key=method.routing_key or "",
            properties={k: v for k, v in properties.items() if v is not None},
            headers=dict(props.headers or {}),
        )

    @property
    def counter_key(self) -> str:
        """Key of the redelivery counter, known without parsing the body (parsing may be what crashes)."""
        message_id = self.properties.get("message_id")
        if isinstance(message_id, str) and message_id:
            return message_id
        return "sha1:" + hashlib.sha1(self.body).hexdigest()

    @property
    def attempt(self) -> int:
        """Broker-level attempt (1 = first delivery; the delay/retry chain adds one per lap)."""
        value = self.headers.get(names.HEADER_ATTEMPT)
        return value if isinstance(value, int) and value >= 1 else 1

    @property
    def final_attempt(self) -> bool:
        return bool(self.headers.get(names.HEADER_FINAL_ATTEMPT))

    def original_routing_key(self, service: str) -> str:
        """Routing key the sender used, also for a delivery that came back through `retry`."""
        prefix = names.inbox_queue(service) + "."
        return self.routing_key.removeprefix(prefix)

    def metadata(self, auth_token: str | None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "properties": {**self.properties, "headers": self.headers},
            "fields": {
                "exchange": self.exchange,
                "routing_key": self.routing_key,
                "delivery_tag": self.delivery_tag,
                "redelivered": self.redelivered,
            },
        }
        if auth_token is not None:
            out["auth_token"] = auth_token
        return out


@dataclass(frozen=True, kw_only=True)
class InboxRow:
    """Column values of one txbox.inbox row."""

    id: uuid.UUID
    message_type: str
    aggregate_type: str
    aggregate_id: str
    message_version: str
    kind: str
    routing_key: str
    payload: str  # JSON text
    message_context: str
    metadata: str
    segment: str
    concurrency: str
    priority: int
    message_timestamp: datetime
    queue: str
    redelivered: bool


def _metadata_text(metadata: dict[str, Any]) -> str:
    """AMQP headers are the sender's, not the message: clean what jsonb refuses rather than reject."""
    text = json_text(metadata)
    if "\\u0000" in text or "\\ud" in text or "NaN" in text or "Infinity" in text:
        text = json_text(dl._storable(metadata))
    return text


def _json_default(value: Any) -> Any:
    if isinstance(value, bytes | bytearray):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


def json_text(value: Any) -> str:
    """Compact JSON of what a delivery carries (AMQP values: bytes, datetimes, decimals too)."""
    return jsoncodec.dumps(value, _json_default)


class Intake:
    """Turns deliveries of one service's inbox queue into rows or dead letters."""

    def __init__(self, registry: Registry, service: str, *, max_body_bytes: int) -> None:
        self.registry = registry
        self.service = service
        self.queue = names.inbox_queue(service)
        self.max_body_bytes = max_body_bytes
        self.accepted = {spec.message_type for spec in registry.accepted_types(service)}

    def reject(
        self,
        delivery: Delivery,
        reason: str,
        error: str,
        *,
        data: Any = None,
        error_type: str = "",
    ) -> dl.DeadLetter:
        message_id = None
        message_type = None
        if isinstance(data, dict):
            with contextlib.suppress(ValueError):
                message_id = uuid.UUID(str(data.get("message_id")))
            if isinstance(data.get("message_type"), str):
                message_type = data["message_type"]
        return dl.DeadLetter(
            source="broker",
            reason=reason,
            error=error,
            error_type=error_type or reason,
            message_id=message_id,
            message_type=message_type,
            routing_key=delivery.original_routing_key(self.service),
            message=data if isinstance(data, dict) else None,
            raw_body=delivery.body,
            headers=json.loads(json_text(delivery.headers)),
            attempts={"broker_attempt": delivery.attempt, "redelivered": delivery.redelivered},
        )

    def admit(self, delivery: Delivery) -> InboxRow | dl.DeadLetter:
        """The row to store, or the dead letter saying why not."""
        size = len(delivery.body)
        if size > self.max_body_bytes:
            return self.reject(
                delivery, dl.TOO_LARGE, f"body of {size} bytes exceeds the limit of {self.max_body_bytes}"
            )
        content_type = delivery.properties.get("content_type")
        if content_type is not None and str(content_type).split(";")[0].strip().lower() != CONTENT_TYPE:
            return self.reject(delivery, dl.WRONG_CONTENT_TYPE, f"content type {content_type!r} is not {CONTENT_TYPE}")
        data: Any = None
        try:
            data = decode_json(delivery.body)
            message = message_from_dict(data)
        except EnvelopeError as exc:
            return self.reject(delivery, exc.reason, str(exc), data=data)
        try:
            spec = self.registry.get(message.message_type)
        except UnknownMessageType as exc:
            return self.reject(delivery, dl.UNKNOWN_MESSAGE_TYPE, str(exc), data=data)
        if spec.message_type not in self.accepted:
            return self.reject(
                delivery,
                NOT_ACCEPTED,
                f"{self.service} neither accepts nor subscribes to {spec.message_type} ({spec.routing_key})",
                data=data,
            )
        try:
            spec.validate(message.payload)
        except PayloadValidationError as exc:
            return self.reject(delivery, dl.SCHEMA_INVALID, str(exc), data=data)
        segment = delivery.headers.get(names.HEADER_SEGMENT)
        if not isinstance(segment, str) or not segment:
            segment = default_segment(message.aggregate_type, message.aggregate_id)
        concurrency = delivery.headers.get(names.HEADER_CONCURRENCY)
        if concurrency not in ("sequential", "parallel"):
            concurrency = "sequential"
        priority = delivery.properties.get("priority")
        priority = max(-32768, min(32767, priority)) if isinstance(priority, int) else 0
        return InboxRow(
            id=message.message_id,
            message_type=spec.message_type,
            aggregate_type=message.aggregate_type,
            aggregate_id=message.aggregate_id,
            message_version=message.message_version,
            kind=spec.kind,
            routing_key=spec.routing_key,
            payload=json_text(message.payload),
            message_context=json_text(message.message_context),
            metadata=_metadata_text(delivery.metadata(message.auth_token)),
            segment=segment,
            concurrency=concurrency,
            priority=priority,
            message_timestamp=message.timestamp.astimezone(UTC),
            queue=self.queue,
            redelivered=delivery.redelivered,
        )
