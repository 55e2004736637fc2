"""`shelf-service`: a command with two versions (tests/fixtures/versions) and its handlers.

``StockShelf`` is version 2 (``quantity`` and ``location``); version 1 had ``count`` only.
:class:`UpcastingShelf` takes version 2 and upcasts version 1; :class:`CurrentOnlyShelf`
takes version 2 only, so a version 1 message has no way into it.

``txbox check --app tests.apps.shelf:current_only`` reports the version it cannot handle.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from framework import CommandHandler, Message, Outbox, Service
from framework.settings import Settings

CONTRACTS = Path(__file__).resolve().parents[1] / "fixtures" / "versions"


def upcast_v1(payload: dict[str, Any]) -> dict[str, Any]:
    """Version 1 → 2: ``count`` became ``quantity``; version 1 knew no location."""
    return {"sku": payload["sku"], "quantity": payload["count"], "location": "unknown"}


class CurrentOnlyShelf(CommandHandler):
    """Records what it is handed: (message_version, payload)."""

    message_type = "StockShelf"

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []
        self.lock = threading.Lock()

    def handle(self, message: Message, session: Session, outbox: Outbox) -> None:
        with self.lock:
            self.seen.append((message.message_version, dict(message.payload)))


class UpcastingShelf(CurrentOnlyShelf):
    upcasters = {"1": upcast_v1}


class BothVersionsShelf(CurrentOnlyShelf):
    versions = frozenset({"1", "2"})


def service(handler: CommandHandler, settings: Settings | None = None) -> Service:
    if settings is None:
        settings = Settings(service="shelf-service", database_url="postgresql://x/y", contracts_dir=CONTRACTS)  # type: ignore[arg-type]
    shelf = Service(settings=settings)
    shelf.register(handler)
    return shelf


current_only = service(CurrentOnlyShelf())
