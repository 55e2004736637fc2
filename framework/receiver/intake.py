"""From a raw delivery to an inbox row or a rejection — pure, so every case is unit-tested.

Every malformation ends as a :class:`~framework.dead_letters.DeadLetter` with a stable
reason code and the raw body; nothing here raises for bad input (outcome REJECTED).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from framework import dead_letters as dl
from framework import expiry, jsoncodec, names
from framework.contracts import MessageSpec, Registry
from framework.envelope import CONTENT_TYPE, Message, decode_json, message_from_dict, peek_top_level
from framework.errors import EnvelopeError, PayloadValidationError, UnknownMessageType
from framework.outbox import default_segment
from framework.reasons import Reason
from framework.selectors import Fields, Selector
from framework.signing import SignatureRejected, Verifier
from framework.sql.inbox import InboxRow

MAX_SEGMENT_CHARS = 1024  # a longer lane name would not fit the inbox's segment index
# Deeper header tables are kept as a marker string (docs/explanation/receive.md, "Receiver intake").
MAX_HEADER_DEPTH = 16
_MAX_KEY_CHARS = 200  # a redelivery counter key is the message id, or a digest


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
    # Published by a trusted broker user (RabbitMQ checked the ``user_id`` property
    # against the publishing connection's user): its control headers count.
    trusted: bool = False
    # Came from the broker (:meth:`from_pika`): its route is checked. Rows built in
    # process from an envelope (tests, benchmarks, tools) have no route to check.
    wire: bool = False
    # The receiver's span for this delivery as a W3C carrier, kept with the inbox row: the
    # handler's span continues it (docs/explanation/operations.md, "Tracing").
    trace: dict[str, str] | None = None

    @classmethod
    def from_pika(cls, method: Any, props: Any, body: bytes, trusted_users: frozenset[str] = frozenset()) -> Delivery:
        # One pass over the properties: this runs for every delivery, on the receiver's loop thread.
        properties = {
            name: value for name in names.BASIC_PROPERTIES if (value := getattr(props, name, None)) is not None
        }
        headers = props.headers
        user_id = properties.get("user_id")
        return cls(
            delivery_tag=method.delivery_tag,
            body=body,
            redelivered=bool(method.redelivered),
            exchange=method.exchange or "",
            routing_key=method.routing_key or "",
            properties=properties,
            headers=dict(headers) if isinstance(headers, dict) else {},
            trusted=isinstance(user_id, str) and user_id in trusted_users,
            wire=True,
        )

    @property
    def counter_key(self) -> str:
        """Key of the redelivery counter, known without parsing the body (parsing may be what crashes).

        The canonical form of a UUID ``message_id``; anything else (absent, NUL,
        overlong, not a UUID, not even text) becomes a digest of that property and the
        body, so the key is always storable and the same on every redelivery.
        """
        message_id = self.properties.get("message_id")
        canonical = _uuid(message_id)
        if canonical is not None:
            return str(canonical)
        digest = hashlib.sha1(repr(message_id).encode("utf-8", "backslashreplace"))
        digest.update(b"\x00")
        digest.update(self.body)
        return "sha1:" + digest.hexdigest()

    @property
    def via_retry(self) -> bool:
        """Came back through our own delay/retry chain (only then do attempt headers count)."""
        return self.trusted and self.exchange == names.RETRY_EXCHANGE

    def control(self, name: str) -> Any:
        """A control header's value when the sender may set it, else None."""
        return self.headers.get(name) if self.trusted else None

    @property
    def attempt(self) -> int:
        """Broker-level attempt (1 = first delivery; the delay/retry chain adds one per lap)."""
        value = self.headers.get(names.HEADER_ATTEMPT) if self.via_retry else None
        return value if type(value) is int and 1 <= value <= 1_000_000 else 1

    @property
    def final_attempt(self) -> bool:
        return self.via_retry and self.headers.get(names.HEADER_FINAL_ATTEMPT) is True

    def lane(self, default: str) -> tuple[str, str, int]:
        """(segment, concurrency, priority) the sender asked for; malformed or untrusted values are ignored."""
        segment = self.control(names.HEADER_SEGMENT)
        if not (
            isinstance(segment, str) and 0 < len(segment) <= MAX_SEGMENT_CHARS and jsoncodec.storable_text(segment)
        ):
            segment = default
        concurrency = self.control(names.HEADER_CONCURRENCY)
        if concurrency not in ("sequential", "parallel"):
            concurrency = "sequential"
        priority = self.control(names.HEADER_PRIORITY)
        if not (type(priority) is int and -32768 <= priority <= 32767):
            # The AMQP property is standard (0-255, any sender may set it, as Mosaic's may).
            priority = self.properties.get("priority")
            priority = priority if type(priority) is int and 0 <= priority <= 255 else 0
        return segment, concurrency, priority

    def original_routing_key(self, service: str) -> str:
        """Routing key the sender used, also for a delivery that came back through `retry`."""
        key = self.retry_key(service)
        return self.routing_key if key is None else key

    def retry_key(self, service: str) -> str | None:
        """The original routing key of a delivery that came through ``retry``, else None.

        The copy parked in a delay queue was published with key ``delay.<n>s`` and CC
        ``<service>:inbox.<original key>``; dead-lettered into ``retry``, it arrives with
        the first as its routing key and the second still in its CC header.
        """
        if self.exchange != names.RETRY_EXCHANGE:
            return None
        prefix = names.retry_routing_key(service, "")
        cc = self.headers.get("CC")
        for key in [self.routing_key, *(cc if isinstance(cc, list) else [])]:
            if isinstance(key, str) and key.startswith(prefix):
                return key[len(prefix) :]
        return None

    def metadata(self, auth_token: str | None, expires_at: float | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "properties": {**self.properties, "headers": jsoncodec.clip_depth(self.headers, MAX_HEADER_DEPTH)},
            "fields": {
                "exchange": self.exchange,
                "routing_key": self.routing_key,
                "delivery_tag": self.delivery_tag,
                "redelivered": self.redelivered,
            },
        }
        if auth_token is not None:
            out["auth_token"] = auth_token
        if self.trace:
            out[names.METADATA_TRACE] = self.trace
        if expires_at is not None:
            out[names.METADATA_EXPIRES_AT] = expires_at
        return out


#: ``DeliveryRejected.reason`` (framework.testing) of a message a selector filters out: not
#: a dead-letter reason, since such a message is no dead letter.
FILTERED = "filtered"


@dataclass(frozen=True)
class Filtered:
    """A delivery its subscription's selector does not match: acked and counted, not stored."""

    message_type: str


def _uuid(value: Any) -> uuid.UUID | None:
    if isinstance(value, str) and len(value) <= _MAX_KEY_CHARS:
        with contextlib.suppress(ValueError):
            return uuid.UUID(value)
    return None


def unparsed_message_id(delivery: Delivery) -> uuid.UUID | None:
    """The id of a delivery whose body did not parse whole (too deep, too large, not JSON).

    The AMQP ``message_id`` property when it is a UUID, else the envelope's top-level
    ``message_id`` read from the body's first bytes without parsing the rest
    (:func:`~framework.envelope.peek_top_level`), else None: an operator finds the letter
    by id either way (docs/explanation/receive.md, "Receiver intake").
    """
    found = _uuid(delivery.properties.get("message_id"))
    return found if found is not None else _uuid(peek_top_level(delivery.body, "message_id"))


def _metadata_text(metadata: dict[str, Any]) -> str:
    """AMQP headers are the sender's, not the message: clean what jsonb refuses rather than reject."""
    text = jsoncodec.amqp_json(metadata)
    if "\\u0000" in text or "\\ud" in text or "NaN" in text or "Infinity" in text:
        text = jsoncodec.amqp_json(jsoncodec.to_storable(metadata))
    return text


class Intake:
    """Turns deliveries of one service's inbox queue into rows or dead letters."""

    def __init__(
        self,
        registry: Registry,
        service: str,
        *,
        max_body_bytes: int,
        selectors: Mapping[str, Selector] | None = None,
        verifier: Verifier | None = None,
    ) -> None:
        self.registry = registry
        # Producers' event signatures (docs/explanation/receive.md, "Event signing"); None: not checked.
        self.verifier = verifier
        # Message type → its handler's selector (framework/selectors.py).
        self.selectors = dict(selectors or {})
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
        else:
            message_id = unparsed_message_id(delivery)
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
            headers=json.loads(jsoncodec.amqp_json(jsoncodec.clip_depth(delivery.headers, MAX_HEADER_DEPTH))),
            attempts={"broker_attempt": delivery.attempt, "redelivered": delivery.redelivered},
        )

    def last_resort(self, delivery: Delivery, error: BaseException | str) -> dl.DeadLetter:
        """An ``internal_error`` letter from the raw delivery alone: nothing here can fail on the input."""
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        return dl.DeadLetter(
            source="broker",
            reason=Reason.INTERNAL_ERROR,
            error=text.encode("ascii", "backslashreplace").decode("ascii")[:2000],
            error_type=Reason.INTERNAL_ERROR if isinstance(error, str) else type(error).__name__,
            routing_key=delivery.routing_key.encode("ascii", "backslashreplace").decode("ascii")[:255],
            raw_body=delivery.body,
            attempts={"redelivered": delivery.redelivered},
        )

    def admit(self, delivery: Delivery) -> InboxRow | dl.DeadLetter | Filtered:
        """The row to store, the dead letter saying why not, or Filtered (a selector did not match);
        never raises (last resort: ``internal_error``)."""
        try:
            return self._admit(delivery)
        except Exception as exc:  # a bug of ours on input nobody foresaw: the input must not stop us
            try:
                return self.reject(
                    delivery, Reason.INTERNAL_ERROR, f"{type(exc).__name__}: {exc}", error_type=type(exc).__name__
                )
            except Exception:
                return self.last_resort(delivery, exc)

    def wrong_route(self, delivery: Delivery, spec: MessageSpec) -> str | None:
        """Why the route a delivery came by is not the one its contract gives it, or None.

        A delivery that came back through our own retry chain carries its original
        routing key (:meth:`Delivery.retry_key`); the exchange it was first sent to is then
        no longer known, the key still is.
        """
        expected = names.exchange_for(spec.kind)
        if delivery.exchange == names.RETRY_EXCHANGE:
            key = delivery.retry_key(self.service)
            if key is not None and spec.routes(key):
                return None
            return f"{spec.message_type} came back through the retry chain with key {key!r}, not {spec.routing_key!r}"
        if delivery.exchange == expected and spec.routes(delivery.routing_key):
            return None
        return (
            f"{spec.message_type} is a {spec.kind} routed by exchange {expected!r} with key {spec.routing_key!r}; "
            f"it came through {delivery.exchange!r} with key {delivery.routing_key!r}"
        )

    def _admit(self, delivery: Delivery) -> InboxRow | dl.DeadLetter | Filtered:
        refused = self._refused_bytes(delivery)
        if refused is not None:
            return refused
        data: Any = None
        try:
            data = decode_json(delivery.body)
            message = message_from_dict(data)
        except EnvelopeError as exc:
            return self.reject(delivery, exc.reason, str(exc), data=data)
        spec = self._spec(delivery, message, data)
        if isinstance(spec, dl.DeadLetter):
            return spec
        refused = self._refused_content(delivery, message, data, spec)
        if refused is not None:
            return refused
        return self._row(delivery, message, data, spec)

    def _refused_bytes(self, delivery: Delivery) -> dl.DeadLetter | None:
        """The dead letter of a body refused before it is parsed: too large, not JSON by its
        content type."""
        size = len(delivery.body)
        if size > self.max_body_bytes:
            return self.reject(
                delivery, Reason.TOO_LARGE, f"body of {size} bytes exceeds the limit of {self.max_body_bytes}"
            )
        content_type = delivery.properties.get("content_type")
        if (
            content_type is not None
            and content_type != CONTENT_TYPE
            and str(content_type).split(";")[0].strip().lower() != CONTENT_TYPE
        ):
            return self.reject(
                delivery, Reason.WRONG_CONTENT_TYPE, f"content type {content_type!r} is not {CONTENT_TYPE}"
            )
        return None

    def _spec(self, delivery: Delivery, message: Message, data: Any) -> MessageSpec | dl.DeadLetter:
        """The contract of ``message``'s type, when this service receives it by the route it
        came; else its dead letter."""
        try:
            spec = self.registry.get(message.message_type)
        except UnknownMessageType as exc:
            return self.reject(delivery, Reason.UNKNOWN_MESSAGE_TYPE, str(exc), data=data)
        if spec.message_type not in self.accepted:
            return self.reject(
                delivery,
                Reason.NOT_ACCEPTED,
                f"{self.service} neither accepts nor subscribes to {spec.message_type} ({spec.routing_key})",
                data=data,
            )
        route_error = self.wrong_route(delivery, spec) if delivery.wire else None
        if route_error is not None:
            return self.reject(delivery, Reason.WRONG_ROUTE, route_error, data=data)
        return spec

    def _refused_content(
        self, delivery: Delivery, message: Message, data: Any, spec: MessageSpec
    ) -> dl.DeadLetter | None:
        """The dead letter of a message its contract refuses: a bad signature, a payload its
        schema does not take."""
        if self.verifier is not None and spec.kind == "event" and delivery.wire:
            try:
                self.verifier.verify(spec.service, delivery.headers, delivery.body)
            except SignatureRejected as exc:
                return self.reject(delivery, exc.reason, str(exc), data=data)
        try:
            spec.validate(message.payload, message.message_version)
        except PayloadValidationError as exc:
            return self.reject(delivery, Reason.SCHEMA_INVALID, str(exc), data=data)
        return None

    def _row(
        self, delivery: Delivery, message: Message, data: Any, spec: MessageSpec
    ) -> InboxRow | dl.DeadLetter | Filtered:
        """The inbox row of an admitted message, unless its filter drops it or it expired."""
        # docs/explanation/receive.md, "Expiry and filters": one lookup each when neither is used.
        selector = self.selectors.get(spec.message_type)
        if selector is not None and not selector.matches(
            Fields(data, delivery.headers, delivery.original_routing_key(self.service))
        ):
            return Filtered(spec.message_type)
        expires_at = None
        if names.HEADER_EXPIRES_AT in delivery.headers:
            expires_at = expiry.from_header(delivery.headers[names.HEADER_EXPIRES_AT])
            if expires_at is not None and expiry.passed(expires_at):
                return self.reject(
                    delivery, Reason.EXPIRED, expiry.describe(expires_at, "before the receiver stored it"), data=data
                )
        return InboxRow.of(
            message,
            message_type=spec.message_type,
            kind=spec.kind,
            # A multi-tenant message keeps the key it came with: it names its tenant.
            routing_key=delivery.original_routing_key(self.service) if spec.tenant_scoped else spec.routing_key,
            metadata=_metadata_text(delivery.metadata(message.auth_token, expires_at)),
            lane=delivery.lane(default_segment(message.aggregate_type, message.aggregate_id)),
            queue=self.queue,
            redelivered=delivery.redelivered,
        )
