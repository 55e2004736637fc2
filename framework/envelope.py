"""The message envelope (the Mosaic format, docs/explanation/relay.md "The envelope"), strict parsing and serialization.

Parsing never trusts its input: every malformation raises :class:`EnvelopeError` with a
stable ``reason`` code (used as the dead-letter reason) and the field at fault.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import MISSING, dataclass, field, fields, replace
from datetime import UTC, datetime
from typing import Any, TypeVar

from framework import jsoncodec
from framework.errors import EnvelopeError
from framework.reasons import Reason

PayloadT = TypeVar("PayloadT")  # a payload class of `txbox codegen` (Message.payload_as)

CONTENT_TYPE = "application/json"
DEFAULT_MESSAGE_VERSION = "1.0"

_REQUIRED_STR = ("message_type", "aggregate_id", "aggregate_type", "message_version")

# Deepest JSON nesting a body may have. Python's parsers reach ~1000 levels and jsonb
# ~10,000, but every later step walks the value recursively (serializing it again, the
# dead letter's cleaning, PostgreSQL's stack); near those limits a message that parsed
# could fail one of them — and fail a whole batch commit. Far below them nothing does.
MAX_JSON_DEPTH = 200

_ABSENT = object()  # a field the envelope does not have (None is JSON's null)


@dataclass(frozen=True, kw_only=True)
class Message:
    """One message: every envelope field, plus where it is in its delivery history.

    ``attempt`` counts handler runs starting at 1; ``is_final_attempt`` tells a handler
    that a failure now abandons the message (it may want to compensate instead).
    """

    message_id: uuid.UUID
    message_type: str
    aggregate_type: str
    aggregate_id: str
    payload: dict[str, Any]
    message_context: dict[str, Any] = field(default_factory=dict)
    timestamp: datetime = field(default_factory=lambda: datetime.now(UTC))
    message_version: str = DEFAULT_MESSAGE_VERSION
    auth_token: str | None = field(default=None, repr=False)
    attempt: int = 1
    max_attempts: int | None = None
    routing_key: str | None = None

    @property
    def is_final_attempt(self) -> bool:
        return self.max_attempts is not None and self.attempt >= self.max_attempts

    @property
    def correlation_id(self) -> str | None:
        """The first ``*correlation_id`` value of the context, for logs and headers."""
        for key, value in self.message_context.items():
            if key.endswith("correlation_id") and isinstance(value, str):
                return value
        return None

    def payload_as(self, cls: type[PayloadT]) -> PayloadT:
        """The payload typed as ``cls``, a payload class of ``txbox codegen`` (a TypedDict).

        Only a promise to the type checker, kept by the schema validation every received
        payload has passed; a class whose required keys the payload lacks is refused.
        """
        missing = sorted(getattr(cls, "__required_keys__", frozenset()) - self.payload.keys())
        if missing:
            raise TypeError(
                f"the payload of {self.message_type} has no {', '.join(missing)}: it is not a {cls.__name__}"
            )
        return self.payload  # type: ignore[return-value]

    def with_delivery(self, *, attempt: int, max_attempts: int | None) -> Message:
        return replace(self, attempt=attempt, max_attempts=max_attempts)

    def to_dict(self) -> dict[str, Any]:
        """The envelope as JSON-ready dict, in the field order of docs/explanation/relay.md, "The envelope"."""
        out: dict[str, Any] = {
            "payload": self.payload,
            "message_context": self.message_context,
            "message_id": str(self.message_id),
            "timestamp": format_timestamp(self.timestamp),
            "message_type": self.message_type,
            "aggregate_id": self.aggregate_id,
            "aggregate_type": self.aggregate_type,
            "message_version": self.message_version,
        }
        if self.auth_token is not None:
            out["auth_token"] = self.auth_token
        return out

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), separators=(",", ":"), ensure_ascii=False).encode()


# The fields a parsed envelope does not set: a delivery's history starts at its defaults.
_MESSAGE_DEFAULTS = {f.name: f.default for f in fields(Message) if f.default is not MISSING}


def format_timestamp(value: datetime) -> str:
    """ISO 8601 in UTC with milliseconds and `Z`, as in the Mosaic example."""
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    value = value.astimezone(UTC)
    return value.strftime("%Y-%m-%dT%H:%M:%S.") + f"{value.microsecond // 1000:03d}Z"


def parse_timestamp(text: str) -> datetime:
    value = datetime.fromisoformat(text.replace("Z", "+00:00") if text.endswith("Z") else text)
    if value.tzinfo is None:
        raise ValueError("timestamp has no time zone")
    return value.astimezone(UTC)


def decode_json(body: bytes | str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Bytes → JSON value, raising EnvelopeError for empty, non-UTF-8, non-JSON or deeper than ``max_depth``."""
    if isinstance(body, bytes | bytearray | memoryview):
        if len(body) == 0:
            raise EnvelopeError(Reason.EMPTY_BODY, "the body is empty")
        try:
            text = bytes(body).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise EnvelopeError(Reason.NOT_UTF8, f"the body is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    else:
        text = body
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise EnvelopeError(Reason.NOT_UTF8, f"the text is not Unicode ({exc.reason} at {exc.start})") from None
    if text.strip() == "":
        raise EnvelopeError(Reason.EMPTY_BODY, "the body is empty")
    try:
        value = jsoncodec.loads(text)
    except RecursionError:
        raise EnvelopeError(Reason.TOO_DEEP, "the JSON is nested too deeply to parse") from None
    except ValueError as exc:
        raise EnvelopeError(Reason.NOT_JSON, f"the body is not JSON ({exc})") from None
    # Nesting needs an opening bracket per level: most bodies have fewer than the limit
    # in all, and skip the walk (two C-speed counts instead).
    if text.count("[") + text.count("{") > max_depth:
        depth = json_depth(value)
        if depth > max_depth:
            raise EnvelopeError(Reason.TOO_DEEP, f"the JSON is nested {depth} levels deep; the limit is {max_depth}")
    if "\\u" in text and _SURROGATE_ESCAPE.search(text):
        _reject_lone_surrogates(value)
    return value


# `\ud800`…`\udfff`: JSON may escape half of a UTF-16 pair alone, which decodes to a
# string no UTF-8 encoder (PostgreSQL, psycopg, our own to_json) accepts. Pairs are fine.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def json_depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0), without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = item.values()
        elif not isinstance(item, list):
            continue
        depth += 1
        deepest = max(deepest, depth)
        stack.extend((child, depth) for child in item if isinstance(child, dict | list))
    return deepest


def _reject_lone_surrogates(value: Any) -> None:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise EnvelopeError(
                    Reason.NOT_UTF8, "a string holds a lone UTF-16 surrogate escape (\\ud800-\\udfff): not Unicode text"
                ) from None


def parse_message(body: bytes | str) -> Message:
    """Strictly parse an envelope from raw bytes (or text)."""
    return message_from_dict(decode_json(body))


def message_from_dict(data: Any) -> Message:
    if not isinstance(data, dict):
        raise EnvelopeError(Reason.NOT_OBJECT, f"the envelope must be a JSON object, not {_json_type(data)}")
    # Every received body passes here: one lookup per field (``get`` with a marker for
    # absence), one test per field, and no helper call unless the field is wrong.
    raw_id = data.get("message_id", _ABSENT)
    if not isinstance(raw_id, str):
        raise _wrong(raw_id, "message_id", "a UUID string")
    try:
        message_id = uuid.UUID(raw_id)
    except ValueError:
        raise EnvelopeError(Reason.INVALID_FIELD, f"{_clip(raw_id)!r} is not a UUID", "message_id") from None

    strings: list[str] = []
    for name in _REQUIRED_STR:
        value = data.get(name, _ABSENT)
        if type(value) is not str and not isinstance(value, str):
            raise _wrong(value, name, "a string")
        if value == "" and name != "message_version":
            raise EnvelopeError(Reason.INVALID_FIELD, "must not be empty", name)
        strings.append(value)
    message_type, aggregate_id, aggregate_type, message_version = strings

    payload = data.get("payload", _ABSENT)
    if not isinstance(payload, dict):
        raise _wrong(payload, "payload", "a JSON object")

    raw_ts = data.get("timestamp", _ABSENT)
    if not isinstance(raw_ts, str):
        raise _wrong(raw_ts, "timestamp", "an ISO 8601 string")
    try:
        timestamp = parse_timestamp(raw_ts)
    except (ValueError, OverflowError):  # OverflowError: year 1 or 9999 shifted out of range by its zone
        raise EnvelopeError(
            Reason.INVALID_FIELD, f"{_clip(raw_ts)!r} is not an ISO 8601 time with zone", "timestamp"
        ) from None

    context = data.get("message_context")
    if not isinstance(context, dict):
        context = _no_context(context)

    token = data.get("auth_token")
    if token is not None and not isinstance(token, str):
        raise EnvelopeError(Reason.INVALID_FIELD, f"must be a string, not {_json_type(token)}", "auth_token")

    # What Message(...) builds, without its frozen __init__'s one object.__setattr__ per
    # field: every received body is parsed here.
    message = object.__new__(Message)
    message.__dict__.update(
        _MESSAGE_DEFAULTS,
        message_id=message_id,
        message_type=message_type,
        aggregate_type=aggregate_type,
        aggregate_id=aggregate_id,
        message_version=message_version,
        payload=payload,
        message_context=context,
        timestamp=timestamp,
        auth_token=token,
    )
    return message


def _no_context(context: Any) -> dict[str, Any]:
    """An envelope's ``message_context`` that is not an object: none (``null``, absent) is
    an empty one; anything else is refused."""
    if context is None:
        return {}
    raise EnvelopeError(Reason.INVALID_FIELD, f"must be a JSON object, not {_json_type(context)}", "message_context")


def _wrong(value: Any, field: str, wanted: str) -> EnvelopeError:
    """The error of a required envelope field that is missing (``_ABSENT``) or not ``wanted``."""
    if value is _ABSENT:
        return EnvelopeError(Reason.MISSING_FIELD, "required field is missing", field)
    return EnvelopeError(Reason.INVALID_FIELD, f"must be {wanted}, not {_json_type(value)}", field)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


# docs/explanation/receive.md, "Receiver intake" (Ids of bodies too deep or too large): a body
# refused before it parsed whole still names its message. Only the first bytes are
# looked at, each once: the three patterns are single character classes (no
# backtracking), and every step moves forward, so the scan is linear in its window.
PEEK_BYTES = 65536
_STRING_STOP = re.compile(rb'["\\]')
_NESTING_STOP = re.compile(rb'["\[\]{}]')
_SCALAR_STOP = re.compile(rb"[,}\]\s]")
_WHITESPACE = b" \t\r\n"
_MAX_PEEKED_CHARS = 256  # a longer key or value is not one a caller looks for


def peek_top_level(body: bytes, key: str, limit: int = PEEK_BYTES) -> str | None:
    """The string value of ``key`` in the top-level JSON object of ``body``, read from its
    first ``limit`` bytes only, or None.

    For a body that cannot or may not be parsed whole (deeper than ``MAX_JSON_DEPTH``,
    larger than the receiver's limit): nested values are skipped by counting brackets,
    never parsed or recursed into; keys and the value found are decoded as JSON strings,
    at most 256 characters each. A key that is not a string, a body that is not an
    object, malformed or cut off by the window before ``key`` is reached: None. The last
    occurrence wins, as in :func:`json.loads`. Never raises.
    """
    head = bytes(body[:limit])
    size = len(head)
    found: str | None = None
    pos = _skip_space(head, 0)
    if head[pos : pos + 1] != b"{":
        return None
    pos = _skip_space(head, pos + 1)
    while pos < size and head[pos : pos + 1] == b'"':
        key_end = _string_end(head, pos + 1)
        if key_end < 0:
            return found
        name = _decoded(head, pos, key_end)
        pos = _skip_space(head, key_end)
        if head[pos : pos + 1] != b":":
            return found
        pos = _skip_space(head, pos + 1)
        end = _value_end(head, pos)
        if end < 0:
            return found
        if name == key and head[pos : pos + 1] == b'"':
            found = _decoded(head, pos, end)
        pos = _skip_space(head, end)
        if head[pos : pos + 1] != b",":
            return found
        pos = _skip_space(head, pos + 1)
    return found


def _skip_space(head: bytes, pos: int) -> int:
    size = len(head)
    while pos < size and head[pos] in _WHITESPACE:
        pos += 1
    return pos


def _string_end(head: bytes, pos: int) -> int:
    """Index after the string whose opening quote is at ``pos - 1``; -1 when cut off."""
    while (stop := _STRING_STOP.search(head, pos)) is not None:
        if stop.group() == b'"':
            return stop.end()
        pos = stop.end() + 1  # an escape: the next byte is part of the string
    return -1


def _decoded(head: bytes, start: int, end: int) -> str | None:
    """The JSON string ``head[start:end]``, or None when it is not one or is too long."""
    if end - start > _MAX_PEEKED_CHARS * 6 + 2:  # six bytes per escaped character at most
        return None
    try:
        text = json.loads(head[start:end])
    except ValueError:  # invalid UTF-8 or escapes, control characters
        return None
    return text if isinstance(text, str) and len(text) <= _MAX_PEEKED_CHARS else None


def _value_end(head: bytes, pos: int) -> int:
    """Index after the value starting at ``pos``; -1 when cut off or malformed."""
    if pos >= len(head):
        return -1
    first = head[pos : pos + 1]
    if first == b'"':
        return _string_end(head, pos + 1)
    if first not in (b"{", b"["):
        stop = _SCALAR_STOP.search(head, pos)
        return -1 if stop is None or stop.start() == pos else stop.start()
    return _nested_end(head, pos + 1)


def _nested_end(head: bytes, pos: int) -> int:
    """Index after the object or array opened at ``pos - 1``, its brackets counted and its
    strings skipped; -1 when cut off or malformed."""
    depth = 1
    while depth and (stop := _NESTING_STOP.search(head, pos)) is not None:
        pos = stop.end()
        char = stop.group()
        if char == b'"':
            pos = _string_end(head, pos)
            if pos < 0:
                return -1
        else:
            depth += 1 if char in (b"{", b"[") else -1
    return pos if depth == 0 else -1
