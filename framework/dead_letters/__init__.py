"""Dead letters: the record every part writes when it gives up on a message, and the
tools over those records.

Receiver rejections, worker and publisher abandons and the broker's dead_letter queue
all end as one row of ``txbox.dead_letters`` built here (:class:`DeadLetter`), in the
same transaction that abandons the message, so a message is never both pending and
dead, nor lost between. Building a row never raises and always yields what PostgreSQL
stores, and a body is kept as a bounded prefix with its length and sha256, a parsed
envelope whole up to :data:`MESSAGE_LIMIT` (docs/explanation/dead-letters.md, "Dead letters").

The modules of this package work on those rows: ``collector`` drains the broker's
``<service>:dead_letter`` queue into them, ``replay`` sends them back for processing or
closes them (``route`` judges where a letter may go), ``queries`` reads them for people
and ``present`` masks what is shown. The terminal (``txbox dlq``) and the web dashboard
(``framework.dashboard``) are thin views over these functions. Importing this module
loads none of them: every daemon that writes a letter imports it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from framework import jsoncodec, names, redaction
from framework.jsoncodec import clean_text, safe_str, to_storable
from framework.reasons import Reason

Source = Literal["broker", "inbox", "outbox"]

# Every pattern below sees sender text (error messages quote payload values). Each runs
# in linear time: no start position scans further than a bounded window or its own run
# (the lookaheads are bounded for that), and only ``_SCAN_LIMIT`` characters are judged
# (see docs/explanation/dead-letters.md, "Dead letters").
# Dashed, or 32 hex digits with a letter among them: 32 plain digits are a number (<n>).
_UUID = re.compile(
    r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"
    r"|\b(?=[0-9]{0,31}[a-fA-F])[0-9a-fA-F]{32}\b"
)
_TIMESTAMP = re.compile(r"\b\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?)?\b")
# The local part is at most 64 characters (RFC 5321); unbounded, ``a.a.a.a…`` is quadratic.
_EMAIL = re.compile(r"\b[\w.+-]{1,64}@[\w-]+(?:\.[\w-]+)+\b")
_HEX = re.compile(r"\b0x[0-9a-fA-F]+\b|\b(?=[0-9]*[a-fA-F])[0-9a-fA-F]{12,}\b")
# PostgreSQL names its objects in double quotes: keep them, they tell bugs apart.
_PG_NAME = re.compile(r'\b(constraint|relation|column|table|index|type|function|schema) "([^"]{1,63})"', re.IGNORECASE)
_QUOTED = re.compile(r"'[^'\n]{0,200}'|\"[^\"\n]{0,200}\"")
_KEY_VALUE = re.compile(r"=\([^)]{0,200}\)")  # PostgreSQL DETAIL: Key (sku)=(ABC-1) already exists
# A token mixing letters and digits (order ids, SKUs, short hashes) differs per message.
# Bounded lookaheads: unbounded, ``a-a-a-a…`` (a word boundary at every character) is quadratic.
_MIXED_ID = re.compile(r"\b(?=[A-Za-z_-]{0,63}\d)(?=[\d_-]{0,63}[A-Za-z])[A-Za-z0-9_-]{6,}\b")
_NUMBER = re.compile(r"(?:(?<![\w-])-)?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
_SPACE = re.compile(r"\s+")
_PGNAME_MARK = "\x00PGNAME\x00"  # NUL never survives into the text (see normalize_error)
_SCAN_LIMIT = 4096  # characters of an error judged: the result keeps 500 anyway


def normalize_error(text: str) -> str:
    """Error text with the parts that differ per message masked, so one bug is one group.

    Masks uuids, timestamps, e-mail addresses, hex ids and addresses, quoted values,
    PostgreSQL key values, tokens mixing letters and digits, and every remaining number
    (also inside words: ``order_42``); keeps PostgreSQL object names (``constraint
    "orders_pkey"``) because two constraints are two bugs. Only the first 4096
    characters are judged, so a long error costs what a short one does.
    """
    text = str(text)[:_SCAN_LIMIT].replace("\x00", "\ufffd")
    text = _UUID.sub("<uuid>", text)
    text = _TIMESTAMP.sub("<ts>", text)
    text = _EMAIL.sub("<email>", text)
    text = _HEX.sub("<hex>", text)
    kept: list[str] = []

    def keep(match: re.Match[str]) -> str:
        kept.append(f'{match.group(1)} "{match.group(2)}"')
        return _PGNAME_MARK

    text = _PG_NAME.sub(keep, text)
    text = _KEY_VALUE.sub("=(<v>)", text)
    text = _QUOTED.sub("<str>", text)
    text = _MIXED_ID.sub("<id>", text)
    text = _NUMBER.sub("<n>", text)
    parts = text.split(_PGNAME_MARK)
    text = "".join(part + (kept[i] if i < len(kept) else "") for i, part in enumerate(parts))
    return _SPACE.sub(" ", text).strip()[:500]


def fingerprint(message_type: str | None, error_type: str, error_text: str) -> str:
    """Group key of a failure: 10,000 failures from one bug share one fingerprint."""
    basis = "\x1f".join((str(message_type or ""), str(error_type), normalize_error(error_text)))
    return hashlib.sha1(basis.encode("utf-8", "surrogatepass")).hexdigest()[:16]


BODY_LIMIT = 64 * 1024
"""Bytes of a raw body a dead letter keeps: beyond it, a prefix with the body's length and sha256."""
MAX_ACCEPTED_BODY = 8 * 1024 * 1024
"""The largest TXBOX_RECEIVER_MAX_BODY_BYTES a receiver may be configured with."""
MESSAGE_LIMIT = 2 * MAX_ACCEPTED_BODY
"""Bytes of a parsed envelope's JSON a dead letter keeps whole; a larger one is kept as a raw
prefix only. Above every body a receiver accepts (compact JSON is not longer than the body
it was parsed from, but for a few escapes), so each message a service accepts stays
replayable (docs/explanation/dead-letters.md, "Dead letters")."""
ERROR_LIMIT = 16 * 1024  # characters of an error text kept (errors may quote whole payloads)


@dataclass(kw_only=True)
class DeadLetter:
    """One row of txbox.dead_letters before insertion.

    :meth:`row` never raises: whatever a sender put into the fields, it returns a row
    PostgreSQL stores (see docs/explanation/dead-letters.md, "Dead letters").
    """

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
        # Made storable first (bounded depth: the scrub recurses), then no auth_token at
        # rest (docs/explanation/operations.md, "Secrets"). Should the scrub fail all the same, the
        # parsed copies go rather than a secret: the raw body is redacted when encoded.
        try:
            self.message = None if self.message is None else to_storable(self.message)
            self.headers = to_storable(self.headers)
            self.attempts = to_storable(self.attempts)
            redaction.scrub_letter(self)
        except Exception as exc:  # the last resort: building a dead letter never raises
            self.message, self.headers, self.attempts = None, {}, {}
            self.error = f"{self.reason}: the letter could not be scrubbed of secrets ({type(exc).__name__})"

    def row(self) -> dict[str, Any]:
        """The row's column values (framework.sql.dead_letters.insert_sql's parameters); never raises.

        Should building the row fail all the same, the row of last resort is reason
        ``internal_error`` with what could be kept: the original reason, the error and
        the body's length and sha256.
        """
        try:
            return self._row()
        except Exception as exc:  # the last resort: one bad letter must never stop its writer
            return self._last_resort_row(exc)

    def _row(self) -> dict[str, Any]:
        headers = to_storable(self.headers)
        if not isinstance(headers, dict):
            headers = {"headers": headers}
        if names.BODY_FACTS in headers:  # a sender's header of that name must not pass for ours
            headers[f"{names.BODY_FACTS} (sender)"] = headers.pop(names.BODY_FACTS)
        message = _json_text(self.message) if self.message is not None else None
        body = self.raw_body
        if message is not None and len(message) > MESSAGE_LIMIT // 4:  # bytes are 1 to 4 per character
            encoded = message.encode("utf-8")
            if len(encoded) > MESSAGE_LIMIT:
                # Never the whole body: the raw body (or the envelope's JSON) keeps a prefix.
                message = None
                body = encoded if body is None else body
        raw = encoding = None
        if body is not None:
            stored = stored_body(body)
            raw, encoding = stored.text, stored.encoding
            headers[names.BODY_FACTS] = stored.facts
            if self.message is not None and message is None:
                headers[names.BODY_FACTS]["message"] = "not kept: its JSON exceeds the body limit"
        return {
            "message_id": _uuid_or_none(self.message_id),
            "source": self.source,
            "reason": clean_text(self.reason, 200),
            "error": clean_text(self.error, ERROR_LIMIT),
            "fingerprint": fingerprint(
                clean_text(self.message_type, 1000), str(self.error_type or self.reason), str(self.error)
            ),
            "message_type": clean_text(self.message_type, 1000),
            "routing_key": clean_text(self.routing_key, 1000),
            "message": message,
            "raw_body": raw,
            "raw_encoding": encoding,
            "headers": _json_text(headers),
            "attempts": _json_text(self.attempts),
            "delivery_key": None,
        }

    def _last_resort_row(self, exc: Exception) -> dict[str, Any]:
        facts: dict[str, Any] = {"error": f"{type(exc).__name__} while building the dead letter"}
        if isinstance(self.raw_body, bytes | bytearray):
            facts.update(length=len(self.raw_body), sha256=hashlib.sha256(self.raw_body).hexdigest())
        error = (
            f"could not build the dead letter ({_ascii(self.reason, 200)}): {type(exc).__name__}: {_ascii(exc, 2000)}"
        )
        return {
            "message_id": _uuid_or_none(self.message_id),
            "source": self.source if self.source in ("broker", "inbox", "outbox") else "broker",
            "reason": Reason.INTERNAL_ERROR,
            "error": error + f"; original error: {_ascii(self.error, 4000)}",
            "fingerprint": fingerprint(None, Reason.INTERNAL_ERROR, type(exc).__name__),
            "message_type": None,
            "routing_key": None,
            "message": None,
            "raw_body": None,
            "raw_encoding": None,
            "headers": json.dumps({names.BODY_FACTS: facts}),
            "attempts": "{}",
            "delivery_key": None,
        }


def internal_error_letter(
    *,
    source: Source,
    error: str,
    raw_body: bytes | None = None,
    headers: dict[str, Any] | None = None,
    message_id: uuid.UUID | None = None,
    routing_key: str | None = None,
) -> DeadLetter:
    """The letter of last resort: reason ``internal_error``, with what could be kept.

    For a delivery txbox failed to judge (a bug, or input nothing foresaw): call it with
    the exception's text and the delivery's body and headers, store the letter and go on
    with the next delivery, instead of failing on the same delivery again and again.
    """
    return DeadLetter(
        source=source,
        reason=Reason.INTERNAL_ERROR,
        error=error,
        error_type=Reason.INTERNAL_ERROR,
        message_id=message_id,
        routing_key=routing_key,
        raw_body=raw_body,
        headers=headers or {},
    )


@dataclass(frozen=True, kw_only=True)
class StoredBody:
    """What a dead letter keeps of a body: ``text`` in ``encoding``, and ``facts`` about the whole."""

    text: str
    encoding: str
    facts: dict[str, Any]


def stored_body(body: bytes) -> StoredBody:
    """The one place a body becomes what a dead letter stores (every writer goes through it).

    At most :data:`BODY_LIMIT` bytes are kept, cut at a UTF-8 character boundary so a
    text body stays text; ``facts`` holds the whole body's ``length`` and ``sha256``,
    the ``stored`` byte count and whether it was ``truncated``. Whatever is to be
    changed in every stored body (redacting secrets, say) belongs here.
    """
    body = bytes(body)
    # Redacted before the cut, so a secret that straddles the limit leaves no prefix of itself.
    kept = _utf8_prefix(redaction.redact_bytes(body), BODY_LIMIT)
    text, encoding = encode_body(kept)
    facts = {
        "length": len(body),
        "sha256": hashlib.sha256(body).hexdigest(),
        "stored": len(kept),
        "truncated": len(kept) < len(body),
    }
    return StoredBody(text=text, encoding=encoding, facts=facts)


def _utf8_prefix(body: bytes, limit: int) -> bytes:
    if len(body) <= limit:
        return body
    for cut in range(limit, max(limit - 4, 0), -1):  # a UTF-8 character has at most 4 bytes
        try:
            body[:cut].decode("utf-8")
            return body[:cut]
        except UnicodeDecodeError:
            continue
    return body[:limit]  # not text anyway: stored as base64


def _ascii(value: Any, limit: int) -> str:
    """Plain ASCII with escapes: storable in any column whatever the value held."""
    return safe_str(value)[:limit].encode("ascii", "backslashreplace").decode("ascii").replace("\x00", "\\x00")


def _json_text(value: Any) -> str:
    return jsoncodec.dumps(to_storable(value))


def _uuid_or_none(value: Any) -> uuid.UUID | None:
    if value is None or isinstance(value, uuid.UUID):
        return value
    try:
        return uuid.UUID(str(value))
    except ValueError:
        return None


def encode_body(body: bytes) -> tuple[str, str]:
    """Raw body for storage: text when it is UTF-8 without NUL, else base64 (redacting is
    :func:`stored_body`'s, before the cut)."""
    try:
        text = body.decode("utf-8")
        if "\x00" not in text:
            return text, "utf-8"
    except UnicodeDecodeError:
        pass
    return base64.b64encode(body).decode("ascii"), "base64"


def decode_body(raw: str, encoding: str) -> bytes:
    return base64.b64decode(raw) if encoding == "base64" else raw.encode("utf-8")
