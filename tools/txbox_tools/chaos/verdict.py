"""The verdict of a chaos run, read from the data — never from the logs.

Logs say what a daemon believed; the tables say what happened. Every check compares
what the run put in (orders placed, stock restocked, the one poison message) with what
both services' databases hold at the end:

- every order reached a final state, and moved there exactly once (``final_transitions``);
- every processed message has exactly one row in the append-only effect counter, and no
  effect exists without its processed mark (the handler's work and the mark commit
  together or not at all);
- nothing was lost between the services: each outbox row of one service is in the inbox
  of the service that consumes it (one id set against the other);
- stock adds up: units reserved equal units of completed orders, nothing created or lost;
- nothing is pending, the poison message is abandoned with reason ``poison``, and the
  dead letters hold exactly that one row.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import psycopg

from framework.reasons import Reason
from txbox_tools.chaos.apps import EFFECTS_TABLE, POISON_CUSTOMER


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""


@dataclass
class Verdict:
    checks: list[Check] = field(default_factory=list)
    handled: int = 0  # inbox rows processed, both services
    relayed: int = 0  # outbox rows published, both services
    lost: int = 0
    duplicated: int = 0
    abandoned: int = 0
    dead_letters: int = 0

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def violations(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    def add(self, name: str, ok: bool, detail: str = "") -> None:
        self.checks.append(Check(name, bool(ok), detail))

    def absorb(self, other: Verdict, prefix: str) -> None:
        """Take in ``other``'s checks, each named after ``prefix``, and add up its counts
        (a run with tenants: one verdict per tenant)."""
        self.checks += [Check(f"{prefix} {c.name}", c.ok, c.detail) for c in other.checks]
        for counted in ("handled", "relayed", "lost", "duplicated", "abandoned", "dead_letters"):
            setattr(self, counted, getattr(self, counted) + getattr(other, counted))


def _one(conn: psycopg.Connection[Any], query: str, params: Any = None) -> Any:
    row = conn.execute(query, params).fetchone()
    return row[0] if row else None


def _ids(conn: psycopg.Connection[Any], query: str) -> set[uuid.UUID]:
    return {row[0] for row in conn.execute(query)}


def _counts(conn: psycopg.Connection[Any], table: str) -> dict[str, int]:
    rows = conn.execute(f"SELECT message_type, count(*) FROM {table} GROUP BY message_type")
    return {t: int(n) for t, n in rows}


def judge(
    orders_dsn: str,
    inventory_dsn: str,
    *,
    orders: int,
    restocks: int,
    stock_units: int,
    poison_id: uuid.UUID | None,
) -> Verdict:
    """All checks; ``orders`` excludes the poison order, ``restocks`` is the RestockItem count."""
    v = Verdict()
    with psycopg.connect(orders_dsn) as o, psycopg.connect(inventory_dsn) as i:
        duplicated = _orders(v, o, orders)
        for label, conn in (("order-service", o), ("inventory-service", i)):
            duplicated += _effects(v, label, conn)
        v.duplicated = duplicated
        _nothing_lost(v, o, i, orders=orders, restocks=restocks, poison_id=poison_id)
        _stock(v, o, i, orders=orders, stock_units=stock_units)
        _only_the_poison(v, o, i, poison_id)
    return v


def _orders(v: Verdict, o: psycopg.Connection[Any], orders: int) -> int:
    """Orders: final, exactly once. Returns the final transitions beyond one per order."""
    row = o.execute(
        "SELECT count(*), count(*) FILTER (WHERE status IN ('completed', 'cancelled')), "
        "count(*) FILTER (WHERE final_transitions = 0), count(*) FILTER (WHERE final_transitions > 1), "
        "coalesce(sum(greatest(final_transitions - 1, 0)), 0) FROM orders WHERE customer <> %s",
        (POISON_CUSTOMER,),
    ).fetchone()
    assert row is not None
    total, final, never, twice, extra_transitions = (int(x) for x in row)
    v.add("every order placed exactly once", total == orders, f"{total:,} orders for {orders:,} placed")
    v.add("every order in a final state", final == orders, f"{final:,}/{orders:,} final, {never:,} never moved")
    v.add("every order moved to its final state exactly once", twice == 0, f"{twice:,} moved more than once")
    poisoned = int(_one(o, "SELECT count(*) FROM orders WHERE customer = %s", (POISON_CUSTOMER,)))
    v.add("the poison order has no business effect", poisoned == 0, f"{poisoned} poison orders stored")
    return extra_transitions


def _effects(v: Verdict, label: str, conn: psycopg.Connection[Any]) -> int:
    """Effects: one per processed message, none without. Returns the effects applied more than once."""
    effects = int(_one(conn, f"SELECT count(*) FROM {EFFECTS_TABLE}"))
    distinct = int(_one(conn, f"SELECT count(DISTINCT message_id) FROM {EFFECTS_TABLE}"))
    v.add(
        f"{label}: every effect applied once",
        effects == distinct,
        f"{effects - distinct:,} effects applied more than once",
    )
    unmarked = int(
        _one(
            conn,
            f"SELECT count(*) FROM {EFFECTS_TABLE} e WHERE NOT EXISTS (SELECT 1 FROM txbox.inbox i "
            "WHERE i.id = e.message_id AND i.processed_at IS NOT NULL)",
        )
    )
    missing = int(
        _one(
            conn,
            "SELECT count(*) FROM txbox.inbox i WHERE i.processed_at IS NOT NULL AND NOT EXISTS "
            f"(SELECT 1 FROM {EFFECTS_TABLE} e WHERE e.message_id = i.id)",
        )
    )
    v.add(
        f"{label}: effects and processed marks commit together",
        unmarked == 0 and missing == 0,
        f"{unmarked:,} effects without a processed mark, {missing:,} processed without effect",
    )
    pending = int(
        _one(conn, "SELECT count(*) FROM txbox.inbox WHERE processed_at IS NULL AND abandoned_at IS NULL")
    ) + int(_one(conn, "SELECT count(*) FROM txbox.outbox WHERE processed_at IS NULL AND abandoned_at IS NULL"))
    v.add(f"{label}: nothing left pending", pending == 0, f"{pending:,} inbox/outbox rows still pending")
    v.handled += int(_one(conn, "SELECT count(*) FROM txbox.inbox WHERE processed_at IS NOT NULL"))
    v.relayed += int(_one(conn, "SELECT count(*) FROM txbox.outbox WHERE processed_at IS NOT NULL"))
    return effects - distinct


def _nothing_lost(
    v: Verdict,
    o: psycopg.Connection[Any],
    i: psycopg.Connection[Any],
    *,
    orders: int,
    restocks: int,
    poison_id: uuid.UUID | None,
) -> None:
    """Nothing lost between the services, and one inbox row per message."""
    o_out = {t: _ids(o, f"SELECT id FROM txbox.outbox WHERE message_type = '{t}'") for t in ("PlaceOrder",)}
    i_out_types = ("RestockItem", "StockReserved", "StockRejected")
    i_out = {t: _ids(i, f"SELECT id FROM txbox.outbox WHERE message_type = '{t}'") for t in i_out_types}
    placed_events = _ids(o, "SELECT id FROM txbox.outbox WHERE message_type = 'OrderPlaced'")
    o_in = _ids(o, "SELECT id FROM txbox.inbox")
    i_in = _ids(i, "SELECT id FROM txbox.inbox")
    lost = {
        "PlaceOrder": len(o_out["PlaceOrder"] - o_in),
        "OrderPlaced": len(placed_events - i_in),
        "RestockItem": len(i_out["RestockItem"] - i_in),
        "StockReserved/Rejected": len((i_out["StockReserved"] | i_out["StockRejected"]) - o_in),
    }
    v.lost = sum(lost.values())
    v.add(
        "nothing lost between the services",
        v.lost == 0,
        ", ".join(f"{k} {n:,}" for k, n in lost.items() if n) or "",
    )
    inbox_types = _counts(o, "txbox.inbox") | _counts(i, "txbox.inbox")
    expected = {
        "PlaceOrder": orders + (1 if poison_id else 0),
        "OrderPlaced": orders,
        "RestockItem": restocks,
    }
    results = inbox_types.get("StockReserved", 0) + inbox_types.get("StockRejected", 0)
    v.add(
        "one inbox row per message",
        all(inbox_types.get(t, 0) == n for t, n in expected.items()) and results == orders,
        ", ".join(f"{k} {n:,}" for k, n in sorted(inbox_types.items())),
    )


def _stock(
    v: Verdict, o: psycopg.Connection[Any], i: psycopg.Connection[Any], *, orders: int, stock_units: int
) -> None:
    """The stock adds up."""
    reserved = int(_one(i, "SELECT coalesce(sum(reserved), 0) FROM stock"))
    stock_now = int(_one(i, "SELECT coalesce(sum(available + reserved), 0) FROM stock"))
    completed_units = int(_one(o, "SELECT coalesce(sum(quantity), 0) FROM orders WHERE status = 'completed'"))
    answers = int(_one(i, "SELECT count(*) FROM reservations"))
    v.add(
        "stock adds up",
        reserved == completed_units and stock_now == stock_units and answers == orders,
        f"reserved {reserved:,} units for {completed_units:,} completed; stock {stock_now:,}/{stock_units:,}; "
        f"{answers:,} reservations for {orders:,} orders",
    )


def _only_the_poison(
    v: Verdict, o: psycopg.Connection[Any], i: psycopg.Connection[Any], poison_id: uuid.UUID | None
) -> None:
    """Abandoned rows and dead letters: the poison message, and nothing else."""
    abandoned: list[tuple[str, uuid.UUID]] = []
    letters: list[tuple[str, uuid.UUID | None, str, str]] = []
    for label, conn in (("order-service", o), ("inventory-service", i)):
        for table in ("inbox", "outbox"):
            for (mid,) in conn.execute(f"SELECT id FROM txbox.{table} WHERE abandoned_at IS NOT NULL"):
                abandoned.append((f"{label} {table}", mid))
        for mid, reason, source in conn.execute("SELECT message_id, reason, source FROM txbox.dead_letters"):
            letters.append((label, mid, reason, source))
    v.abandoned = len(abandoned)
    v.dead_letters = len(letters)
    want_abandoned = [("order-service inbox", poison_id)] if poison_id else []
    v.add("only the poison message was abandoned", abandoned == want_abandoned, f"abandoned: {abandoned[:5]}")
    want_letters = [("order-service", poison_id, Reason.POISON, "inbox")] if poison_id else []
    v.add(
        "the dead letters hold the poison message (reason poison) and nothing else",
        letters == want_letters,
        f"dead letters: {letters[:5]}{' …' if len(letters) > 5 else ''}",
    )
