"""Headers of the copies the receiver publishes (retries, dead letters) can always be sent again."""

from __future__ import annotations

import struct
from decimal import Decimal

import pika.data
import pytest

from framework import amqp


def decoded(encoded_value: bytes) -> object:
    """What pika hands the receiver for one header value as it came off the wire."""
    table = struct.pack(">B", 1) + b"x" + encoded_value
    headers, _ = pika.data.decode_table(struct.pack(">I", len(table)) + table, 0)
    return headers["x"]


def test_values_pika_decodes_but_cannot_encode_are_replaced_one_by_one() -> None:
    huge = decoded(b"d" + struct.pack(">d", 1e19))  # a plain client's double: pika makes it an int past 64 bits
    assert huge == 10**19
    with pytest.raises(struct.error):
        pika.data.encode_table([], {"x": huge})
    # A Decimal past the 32-bit field: 1e10 fails as 1e999999 does, without pika's int() of a
    # million-digit number (minutes of CPU under load).
    headers = {"x-huge": huge, "x-decimal": Decimal("1e10"), "x-ok": "text", "x-n": 7, "x-t": {"a": [1, "b"]}}
    copied = amqp.encodable_headers(headers)
    assert copied == {
        "x-huge": amqp.UNENCODABLE_FIELD,
        "x-decimal": amqp.UNENCODABLE_FIELD,
        "x-ok": "text",
        "x-n": 7,
        "x-t": {"a": [1, "b"]},
    }
    pika.data.encode_table([], copied)  # the copy can be published
