"""The dead-letter record every part writes when it gives up on a message (DESIGN §4).

Receiver rejections, worker and publisher abandons and the broker's dead_letter queue
all end as one row of ``txbox.dead_letters`` built here, in the same transaction that
abandons the message, so a message is never both pending and dead, nor lost between.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from psycopg import sql

from framework import names, redaction

Source = Literal["broker", "inbox", "outbox"]

# Reason codes beyond the envelope's (framework.envelope holds those for malformed input).
UNKNOWN_MESSAGE_TYPE = "unknown_message_type"
SCHEMA_INVALID = "schema_invalid"
TOO_LARGE = "too_large"
WRONG_CONTENT_TYPE = "wrong_content_type"
REDELIVERY_LIMIT = "redelivery_limit"
RETRIES_EXHAUSTED = "retries_exhausted"  # broker-level delay/retry chain used up
MAX_ATTEMPTS = "max_attempts"
PERMANENT_ERROR = "permanent_error"
POISON = "poison"
UNROUTABLE = "unroutable"
NACKED = "nacked"

# Dashed, or 32 hex digits with a letter among them: 32 plain digits are a number (<n>).
_UUID = re.compile(
    r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"
    r"|\b(?=[0-9]*[a-fA-F])[0-9a-fA-F]{32}\b"
)
_TIMESTAMP = re.compile(r"\b\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?)?\b")
_EMAIL = re.compile(r"\b[\w.+-]+@[\w-]+(?:\.[\w-]+)+\b")
_HEX = re.compile(r"\b0x[0-9a-fA-F]+\b|\b(?=[0-9]*[a-fA-F])[0-9a-fA-F]{12,}\b")
# PostgreSQL names its objects in double quotes: keep them, they tell bugs apart.
_PG_NAME = re.compile(r'\b(constraint|relation|column|table|index|type|function|schema) "([^"]{1,63})"', re.IGNORECASE)
_QUOTED = re.compile(r"'[^'\n]{0,200}'|\"[^\"\n]{0,200}\"")
_KEY_VALUE = re.compile(r"=\([^)]{0,200}\)")  # PostgreSQL DETAIL: Key (sku)=(ABC-1) already exists
# A token mixing letters and digits (order ids, SKUs, short hashes) differs per message.
_MIXED_ID = re.compile(r"\b(?=[A-Za-z_-]*\d)(?=[\d_-]*[A-Za-z])[A-Za-z0-9_-]{6,}\b")
_NUMBER = re.compile(r"(?:(?<![\w-])-)?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
_SPACE = re.compile(r"\s+")


def normalize_error(text: str) -> str:
    """Error text with the parts that differ per message masked, so one bug is one group.

    Masks uuids, timestamps, e-mail addresses, hex ids and addresses, quoted values,
    PostgreSQL key values, tokens mixing letters and digits, and every remaining number
    (also inside words: ``order_42``); keeps PostgreSQL object names (``constraint
    "orders_pkey"``) because two constraints are two bugs.
    """
    text = _UUID.sub("<uuid>", text)
    text = _TIMESTAMP.sub("<ts>", text)
    text = _EMAIL.sub("<email>", text)
    text = _HEX.sub("<hex>", text)
    kept: list[str] = []

    def keep(match: re.Match[str]) -> str:
        kept.append(f'{match.group(1)} "{match.group(2)}"')
        return "\x00PGNAME\x00"

    text = _PG_NAME.sub(keep, text)
    text = _KEY_VALUE.sub("=(<v>)", text)
    text = _QUOTED.sub("<str>", text)
    text = _MIXED_ID.sub("<id>", text)
    text = _NUMBER.sub("<n>", text)
    text = re.sub("\x00PGNAME\x00", lambda _m: kept.pop(0), text)
    return _SPACE.sub(" ", text).strip()[:500]


def fingerprint(message_type: str | None, error_type: str, error_text: str) -> str:
    """Group key of a failure: 10,000 failures from one bug share one fingerprint."""
    basis = "\x1f".join((message_type or "", error_type, normalize_error(error_text)))
    return hashlib.sha1(basis.encode()).hexdigest()[:16]


@dataclass(kw_only=True)
class DeadLetter:
    """One row of txbox.dead_letters before insertion."""

    source: Source
    reason: str
    error: str
    error_type: str = ""
    message_id: uuid.UUID | None = None
    message_type: str | None = None
    routing_key: str | None = None
    message: dict[str, Any] | None = None  # the parsed envelope, when there was one
    raw_body: bytes | None = None  # the delivery as received, when it was not a valid envelope
    headers: dict[str, Any] = field(default_factory=dict)
    attempts: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        redaction.scrub_letter(self)  # no auth_token at rest (docs/architecture.md, "Secrets")

    def row(self) -> dict[str, Any]:
        raw, encoding = encode_body(self.raw_body) if self.raw_body is not None else (None, None)
        return {
            "message_id": self.message_id,
            "source": self.source,
            "reason": _storable(self.reason),
            "error": _storable(self.error),
            "fingerprint": fingerprint(self.message_type, self.error_type or self.reason, self.error),
            "message_type": _storable(self.message_type),
            "routing_key": _storable(self.routing_key),
            "message": json.dumps(_storable(self.message), default=str) if self.message is not None else None,
            "raw_body": raw,
            "raw_encoding": encoding,
            "headers": json.dumps(_storable(self.headers), default=str),
            "attempts": json.dumps(_storable(self.attempts), default=str),
        }


def _storable(value: Any) -> Any:
    """``value`` with what PostgreSQL refuses replaced: NUL and lone surrogates (text, jsonb), NaN/±Infinity (jsonb).

    A dead letter is the last resort for hostile input; if its row could not be stored
    the receiver would crash on the same delivery again and again. The raw body keeps
    the exact bytes, so nothing is lost by cleaning the parsed copies.
    """
    if isinstance(value, str):
        if "\x00" in value:
            value = value.replace("\x00", "\ufffd")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            value = value.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
        return value
    if isinstance(value, dict):
        return {_storable(str(k)): _storable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_storable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def encode_body(body: bytes) -> tuple[str, str]:
    """Raw body for storage, secrets redacted: text when it is UTF-8 without NUL, else base64."""
    body = redaction.redact_bytes(body)
    try:
        text = body.decode("utf-8")
        if "\x00" not in text:
            return text, "utf-8"
    except UnicodeDecodeError:
        pass
    return base64.b64encode(body).decode("ascii"), "base64"


def decode_body(raw: str, encoding: str) -> bytes:
    return base64.b64decode(raw) if encoding == "base64" else raw.encode("utf-8")


_COLUMNS = (
    "message_id",
    "source",
    "reason",
    "error",
    "fingerprint",
    "message_type",
    "routing_key",
    "message",
    "raw_body",
    "raw_encoding",
    "headers",
    "attempts",
)


def insert_sql(schema: str) -> sql.Composed:
    """Named INSERT for psycopg (``cursor.execute(insert_sql(s), letter.row())``)."""
    return sql.SQL("INSERT INTO {table} ({cols}) VALUES ({vals})").format(
        table=sql.Identifier(schema, names.DEAD_LETTERS),
        cols=sql.SQL(", ").join(map(sql.Identifier, _COLUMNS)),
        vals=sql.SQL(", ").join(sql.Placeholder(c) for c in _COLUMNS),
    )
