"""The example services as the chaos run deploys them: same handlers, plus two things.

1. **An effect counter.** Every handler run appends one row to ``chaos_effects`` in the
   handler's own transaction. The table has no key and no constraint on purpose: the
   examples' primary keys (``orders.id``, ``reservations.order_id``) would turn a double
   apply into an error and hide it, while an append-only counter shows it as a second
   row. Exactly-once means one row per processed message, no more, no less.
2. **A poison message.** A PlaceOrder from customer :data:`POISON_CUSTOMER` kills the
   worker process that runs its handler (``SIGKILL`` from inside, as a segfaulting C
   extension would). The worker must recognise it by its unfinished attempts, abandon it
   with reason ``poison`` and carry on with everything else.

The examples are wrapped (subclassed), never edited. The business tables of both
services (the examples' own) plus ``chaos_effects`` are created by :func:`prepare`.

Daemons use ``--app txbox_tools.chaos.apps:orders`` / ``--app txbox_tools.chaos.apps:inventory``
with ``TXBOX_DATABASE_URL`` / ``TXBOX_AMQP_URL`` of the run's private servers.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session

from framework import Message, Outbox, Service
from framework.handlers import Handler
from txbox_tools import repository

repository.import_examples()

from examples import _defaults  # noqa: E402
from examples.inventory import app as inventory_app  # noqa: E402
from examples.orders import app as orders_app  # noqa: E402

#: A PlaceOrder from this customer crashes the process handling it.
POISON_CUSTOMER = "chaos-poison"
#: The append-only effect counter (a business table of the chaos app, in each service's database).
EFFECTS_TABLE = "chaos_effects"
EFFECTS_DDL = f"CREATE TABLE IF NOT EXISTS {EFFECTS_TABLE} (message_id uuid NOT NULL, message_type text NOT NULL)"

_RECORD = text(f"INSERT INTO {EFFECTS_TABLE} (message_id, message_type) VALUES (:id, :type)")


class Counted(Handler):
    """Mixin: record the effect, then run the example's handler in the same transaction."""

    def handle(self, message: Message, session: Session, outbox: Outbox) -> None:
        if message.payload.get("customer") == POISON_CUSTOMER:
            os.kill(os.getpid(), signal.SIGKILL)
        session.execute(_RECORD, {"id": message.message_id, "type": message.message_type})
        super().handle(message, session, outbox)


class PlaceOrder(Counted, orders_app.PlaceOrder):
    pass


class StockReserved(Counted, orders_app.StockReserved):
    pass


class StockRejected(Counted, orders_app.StockRejected):
    pass


class RestockItem(Counted, inventory_app.RestockItem):
    pass


class ReserveStock(Counted, inventory_app.ReserveStock):
    pass


def _service(name: str, default_db: str, handlers: list[Handler]) -> Service:
    service = Service.from_env(
        service=name,
        database_url=os.environ.get("TXBOX_DATABASE_URL") or _defaults.database_url(default_db),
        contracts_dir=_defaults.contracts_dir(),
    )
    service.jwt = _defaults.jwt_settings()  # RestockItem requires a token (examples/inventory/app.py)
    for handler in handlers:
        service.register(handler)
    return service


orders = _service("order-service", "txbox_chaos_orders", [PlaceOrder(), StockReserved(), StockRejected()])
inventory = _service("inventory-service", "txbox_chaos_inventory", [RestockItem(), ReserveStock()])

#: Short name (as in daemon names ``orders-worker``) → (app spec, example package).
APPS: dict[str, tuple[str, str]] = {
    "orders": ("txbox_tools.chaos.apps:orders", "orders"),
    "inventory": ("txbox_tools.chaos.apps:inventory", "inventory"),
}


def prepare(example: str, database_url: str) -> None:
    """Framework + business migrations of ``example``, and the effect counter table."""
    import psycopg

    from examples import migrate
    from framework.db import conninfo

    migrate.upgrade(example, database_url)
    with psycopg.connect(conninfo(database_url), autocommit=True) as conn:
        conn.execute(EFFECTS_DDL)


def with_urls(service: Service, database_url: str, amqp_url: str) -> Service:
    """The same service (same handlers) pointed at the run's private servers."""
    return service.with_settings(database_url=database_url, amqp_url=amqp_url)


def __getattr__(name: str) -> Any:  # pragma: no cover - a clear error for a typo in --app
    raise AttributeError(f"txbox_tools.chaos.apps has no {name!r}; use `orders` or `inventory`")
