"""The SQL of txbox, one module per table: its statements and its one row codec.

``outbox``, ``inbox``, ``dead_letters`` and ``redeliveries``; ``messages`` and
``pending`` for statements that serve the outbox and the inbox alike, ``retention`` for
the pruners' pages of both; ``reports`` for
the report tables of ``txbox analyze``. Every writer of a table goes through that
table's one INSERT, and claimed rows are read by column name. The SQLAlchemy metadata
the migrations are checked against stays in framework/tables.py (docs/explanation/daemons.md,
"Tables and their SQL").
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from psycopg import sql

from framework.errors import TxboxError


def rendered(statement: sql.Composable) -> bytes:
    """``statement`` as the bytes psycopg sends, rendered once for a daemon's hot path.

    psycopg composes a ``sql.Composed`` statement again at every execute, adapting each
    identifier and literal anew, which a batch of one pays in full (docs/explanation/daemons.md,
    "Tables and their SQL"). Rendered without a connection: right only while its names
    and literals are ASCII, the same bytes in every client encoding, which is checked here.
    """
    text = statement.as_bytes()
    if not text.isascii():
        raise TxboxError(f"a statement rendered once must be ASCII, whatever the client encoding: {text[:200]!r}")
    return text


_PLACEHOLDER = re.compile(rb"%\((\w+)\)s|%%")


def positional(rendered: bytes, names: Sequence[str], casts: Mapping[str, str] | None = None) -> bytes:
    """A :func:`rendered` statement (``%(name)s``, ``%%``) with libpq's ``$n`` instead, for
    statements a daemon prepares and sends with libpq's own calls: ``$n`` is the place of
    the name in ``names``, with ``::cast`` from ``casts``. Raises on a name not in ``names``."""

    def one(match: re.Match[bytes]) -> bytes:
        if match.group(0) == b"%%":
            return b"%"
        name = match.group(1).decode()
        if name not in names:
            raise TxboxError(f"the statement has a parameter {name!r} that is not passed: {rendered[:200]!r}")
        cast = (casts or {}).get(name)
        return b"$%d" % (names.index(name) + 1) + (f"::{cast}".encode() if cast else b"")

    return _PLACEHOLDER.sub(one, rendered)
