"""The relay's claims, sent and collected on the relay's loop (docs/explanation/daemons.md, "One thread per daemon").

A claim is one statement in autocommit (framework/sql/outbox.py: it marks the rows
confirmed since the last one and leases the next heads of their lanes). The loop sends
it with libpq's asynchronous calls and reads its rows when the database socket says they
came, so the loop publishes the batch in hand while PostgreSQL claims the next one, on
the one thread that owns both. At most one claim is in flight, and nothing else runs on
the connection meanwhile.

The two claim statements are prepared once per connection under names of their own
(with ``generic_plans`` the connection keeps one plan for them: docs/explanation/daemons.md,
"Generic plans"). Their parameters go as text: the ids to mark as one array literal,
which costs a join instead of psycopg adapting every id.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import pq
from psycopg.adapt import Transformer

from framework.errors import DatabaseUnavailable, TxboxError
from framework.sql import positional
from framework.sql.outbox import Claimed

PARAMETERS = ("limit", "lease", "window", "marked", "ages")
# Their types (int8, float8, int8, uuid[], float8[]): one claim does not use ``window``,
# and PostgreSQL cannot prepare a statement with a parameter of no known type.
_TYPES = [20, 701, 20, 2951, 1022]
_FIELD_NAMES = [name.encode() for name in Claimed._fields]


def parameters(limit: int, lease: float, marked: Sequence[str], ages: Sequence[float]) -> list[bytes]:
    """The claim's parameters as text, in :data:`PARAMETERS` order (``window``: four times the limit)."""
    return [
        str(limit).encode(),
        repr(float(lease)).encode(),
        str(limit * 4).encode(),
        ("{" + ",".join(marked) + "}").encode(),
        ("{" + ",".join(f"{age:.6f}" for age in ages) + "}").encode(),
    ]


class Claims:
    """The claim statements on one connection: :meth:`prepare` each new one, then
    :meth:`send` a claim and :meth:`collect` its rows."""

    def __init__(self, statements: dict[str, bytes]) -> None:
        self._statements = {name.encode(): positional(text, PARAMETERS) for name, text in statements.items()}
        self._transformer: Any = None  # psycopg.adapt.Transformer of the connection (a variable to mypy)
        self.in_flight = False

    def prepare(self, conn: psycopg.Connection[Any]) -> None:
        """Prepare the statements on a new connection and check they return :class:`Claimed`'s fields."""
        self.in_flight = False
        pgconn = conn.pgconn
        for name, text in self._statements.items():
            result = pgconn.prepare(name, text, _TYPES)
            if result.status != pq.ExecStatus.COMMAND_OK:
                raise psycopg.errors.error_from_result(result, encoding=conn.info.encoding)
            described = pgconn.describe_prepared(name)
            fields = [described.fname(i) for i in range(described.nfields)]
            if fields != _FIELD_NAMES:
                raise TxboxError(f"the claim {name.decode()} returns {fields}, not the fields of Claimed")
        self._transformer = Transformer(conn)

    def send(self, conn: psycopg.Connection[Any], name: str, params: list[bytes]) -> None:
        """Send a claim and return at once (the socket takes so small a statement whole)."""
        assert not self.in_flight, "a claim is in flight"
        pgconn = conn.pgconn
        pgconn.send_query_prepared(name.encode(), params)
        while pgconn.flush():  # not sent whole: the socket is full, which a claim of this size rarely meets
            pass
        self.in_flight = True

    def collect(self, conn: psycopg.Connection[Any]) -> list[Claimed] | None:
        """The rows of the claim in flight, in claim order, once they have come; None while
        they have not (the socket said readable for a NOTIFY, or for part of the answer)."""
        pgconn = conn.pgconn
        pgconn.consume_input()
        if pgconn.is_busy():
            return None
        results = []
        while (result := pgconn.get_result()) is not None:
            results.append(result)
        self.in_flight = False
        if len(results) != 1:
            raise DatabaseUnavailable(f"a claim got {len(results)} results instead of one")
        [result] = results
        if result.status != pq.ExecStatus.TUPLES_OK:
            raise psycopg.errors.error_from_result(result, encoding=conn.info.encoding)
        transformer = self._transformer
        transformer.set_pgresult(result)
        rows: list[Claimed] = transformer.load_rows(0, result.ntuples, Claimed._make)
        return rows
