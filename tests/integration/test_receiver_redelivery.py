"""The receiver's redelivery counter, with a receiver process killed (-9) while it holds a message.

docs/explanation/receive.md, "Receiver intake".

How the receiver is made to die *holding one given message*, without a test hook in the
product: the test inserts that message's id into txbox.inbox in a transaction it keeps
open. The receiver's ``INSERT ... ON CONFLICT (id) DO NOTHING`` must wait for that row
lock, so it stalls with the delivery unacked — visible in pg_stat_activity as a backend
of ``txbox-receiver`` waiting on a Lock — and the test kills it with SIGKILL right then.
RabbitMQ redelivers with ``redelivered=true``; each restart counts it in
txbox.redeliveries before touching it, and past the limit the message goes to the dead
letters while the messages queued behind it are stored.
"""

from __future__ import annotations

import json
import os
import uuid

import pika
import psycopg

from framework import names, topology
from framework.db import conninfo
from framework.receiver import Delivery, Intake
from framework.sql.inbox import InboxRow, insert_rows
from tests import support
from tests.apps import counter
from tests.apps.helpers import publish, query, scalar
from txbox_tools.processes import ProcessGroup

LIMIT = 3


def receiver_waits_on_a_lock(url: str) -> bool:
    return bool(
        scalar(
            url,
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'txbox-receiver'"
            " AND wait_event_type = 'Lock' AND datname = current_database()",
        )
    )


def test_a_message_that_kills_the_receiver_is_dead_lettered_after_the_limit(
    database_url: str, amqp_url: str, processes: ProcessGroup
) -> None:
    env = {
        "TXBOX_DATABASE_URL": database_url,
        "TXBOX_AMQP_URL": amqp_url,
        "TXBOX_QUEUE_TYPE": os.environ.get("TXBOX_QUEUE_TYPE", "quorum"),
    }
    app = counter.build(env)
    topology.declare(app.settings, app.registry)
    victim = counter.envelope(0)
    victim_id = json.loads(victim)["message_id"]
    others = [counter.envelope(n) for n in range(1, 11)]

    # Hold the victim's inbox row in an open transaction: the receiver will stall on it.
    blocker = psycopg.connect(conninfo(database_url))
    row = Intake(app.registry, app.name, max_body_bytes=1 << 20).admit(Delivery(delivery_tag=1, body=victim))
    assert isinstance(row, InboxRow)
    with blocker.cursor() as cur:
        insert_rows(cur, "txbox", [row])

    props = [
        pika.BasicProperties(content_type="application/json", delivery_mode=2, message_id=json.loads(b)["message_id"])
        for b in (victim, *others)
    ]
    publish(amqp_url, [victim, *others], routing_key=counter.ROUTING_KEY, properties=props)

    def dead() -> bool:
        return bool(scalar(database_url, "SELECT count(*) FROM txbox.dead_letters"))

    kills = 0
    try:
        while not dead():
            assert kills <= LIMIT + 2, "the receiver should have given up on the message by now"
            receiver = processes.start(
                f"receiver-{kills}",
                ["receiver", "--app", "tests.apps.counter:service"],
                env={**env, "TXBOX_RECEIVER_REDELIVERY_LIMIT": str(LIMIT)},
            )
            support.wait_until(
                lambda: receiver_waits_on_a_lock(database_url) or dead(),
                30,
                message=f"the receiver to stall on the message or dead-letter it\n{receiver.log_tail()}",
            )
            if not dead():
                processes.kill(receiver)  # SIGKILL while it holds the delivery
                kills += 1
                # A backend waiting on a lock does not notice its client died until it
                # next talks to it; end it the way a server-side client check would.
                query(
                    database_url,
                    # This test's database only: the server is shared with other suites' receivers.
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE application_name = 'txbox-receiver' AND datname = current_database()",
                )
                # Gone, not only signalled: a backend still listed as waiting would make the
                # next receiver look stalled before it took the delivery (and count no kill).
                support.wait_until(
                    lambda: (
                        not scalar(
                            database_url,
                            "SELECT count(*) FROM pg_stat_activity "
                            "WHERE application_name = 'txbox-receiver' AND datname = current_database()",
                        )
                    ),
                    30,
                    message="the killed receiver's backend to end",
                )
    finally:
        blocker.rollback()
        blocker.close()

    # First delivery plus LIMIT counted redeliveries died; the next one was dead-lettered.
    assert kills == LIMIT + 1
    [(message_id, source, reason, raw)] = query(
        database_url, "SELECT message_id, source, reason, raw_body FROM txbox.dead_letters"
    )
    assert (str(message_id), source, reason) == (victim_id, "broker", "redelivery_limit")
    assert json.loads(raw)["message_id"] == victim_id
    stored = {json.loads(b)["message_id"] for b in others}
    support.wait_until(
        lambda: {str(r[0]) for r in query(database_url, "SELECT id FROM txbox.inbox")} == stored,
        30,
        message="the messages behind it to be stored",
    )
    assert scalar(database_url, "SELECT count(*) FROM txbox.redeliveries") == 0, "settled counters are dropped"
    assert uuid.UUID(victim_id) not in {r[0] for r in query(database_url, "SELECT id FROM txbox.inbox")}
    assert names.inbox_queue(app.name) == "counter-service:inbox"
