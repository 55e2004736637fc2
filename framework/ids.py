"""The ids txbox gives messages: UUIDv7, ordered by the time they were made.

A message id is the primary key of its outbox row and, at the receiving service, of its
inbox row. A random (version 4) id lands on a different page of that index with every
insert; over a table that holds months of finished rows, each of those pages is read
back and its first change after a checkpoint writes a whole page image to the WAL. Ids
that begin with the time land beside each other, at the index's growing edge
(docs/explanation/how-it-works.md, "The tables"). They are still UUIDs, unique without coordination
(74 random bits per millisecond), and any peer may keep sending version 4 ids.
"""

from __future__ import annotations

import json
import os
import time
import uuid

from framework import names

_VERSION = 0x7 << 76
_VARIANT = 0x2 << 62
_KEEP = ~((0xF << 76) | (0x3 << 62))  # everything but the version and variant bits


def message_id() -> uuid.UUID:
    """A new UUIDv7 (RFC 9562): 48 bits of Unix time in milliseconds, then random bits."""
    value = (time.time_ns() // 1_000_000) << 80 | int.from_bytes(os.urandom(10), "big")
    return uuid.UUID(int=value & _KEEP | _VERSION | _VARIANT)


def sent_id(incoming: uuid.UUID, service: str, handler: str, message_type: str, ordinal: int) -> uuid.UUID:
    """The id of a message a handler run sends: a name-based UUID (version 5) under
    :data:`framework.names.MESSAGE_ID_NAMESPACE`, the same for the same inputs in every run.

    ``ordinal`` counts this run's earlier sends of ``message_type`` that it keeps (from 0; a
    savepoint rolled back gives its sends' ordinals back), so a handler run again after a
    crash before its commit, or after a failover that lost that commit, sends copies under
    the ids of the first run, which the receiving inbox drops as duplicates
    (docs/explanation/write.md, "Ids of the messages a handler sends"). The name is a JSON array,
    so no two distinct inputs share one.
    """
    name = json.dumps([str(incoming), service, handler, message_type, ordinal], ensure_ascii=True)
    return uuid.uuid5(names.MESSAGE_ID_NAMESPACE, name)
