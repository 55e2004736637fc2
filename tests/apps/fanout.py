"""`fanout-service`: the test service of the re-run tests (docs/explanation/write.md, "Ids of the
messages a handler sends").

Every ``Fan`` command sends two ``Count`` commands to `counter-service`
(:mod:`tests.apps.counter`), whose handler counts each message id it is handed: a handler
run again whose copies came under new ids would show there as four counters, not two.
A payload with ``"hold": path`` makes the first run, the one that finds no file at
``path``, write the ids it sent there (JSON, renamed into place) and block in C until its
process is killed: the moment after the handler sent and before its transaction commits.

Run: ``txbox worker --app tests.apps.fanout:service`` with ``TXBOX_DATABASE_URL`` and
``TXBOX_AMQP_URL`` set (the contracts folder is :mod:`tests.apps.counter`'s, which holds
both services).
"""

from __future__ import annotations

import json
import os
import threading
import uuid
from pathlib import Path

from sqlalchemy.orm import Session

from framework import CommandHandler, Message, Outbox, Service
from framework.envelope import Message as Envelope
from framework.settings import Settings
from tests.apps.counter import CONTRACTS

SERVICE = "fanout-service"
ROUTING_KEY = "fanout-service.fan.spread"
SENDS = 2


class Fan(CommandHandler):
    message_type = "Fan"

    def handle(self, message: Message, session: Session, outbox: Outbox) -> None:
        sent = [
            outbox.send_command("Count", aggregate_id=f"{message.aggregate_id}-{n}", payload={"n": n})
            for n in range(SENDS)
        ]
        hold = message.payload.get("hold")
        if hold and not os.path.exists(hold):
            partial = Path(f"{hold}.partial")
            partial.write_text(json.dumps([str(i) for i in sent]))
            partial.rename(hold)  # the test reads it whole or not at all
            threading.Event().wait()  # blocked in C: no timeout interrupts it, only the kill


def build(environ: dict[str, str] | None = None) -> Service:
    settings = Settings.from_env(environ, service=SERVICE, contracts_dir=CONTRACTS)
    app = Service(settings=settings)
    app.register(Fan())
    return app


def envelope(aggregate_id: str, *, hold: Path | None = None) -> bytes:
    """A Fan envelope as a sender would publish it."""
    message = Envelope(
        message_id=uuid.uuid4(),
        message_type="Fan",
        aggregate_type="fan",
        aggregate_id=aggregate_id,
        payload={"hold": str(hold)} if hold is not None else {},
    )
    return json.dumps(message.to_dict()).encode()


# Built from TXBOX_* when imported by `txbox ... --app tests.apps.fanout:service`.
service = build() if os.environ.get("TXBOX_DATABASE_URL") else None
