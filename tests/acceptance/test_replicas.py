"""Two receivers and two workers of one service, as processes, killed in turn: nothing is
lost or doubled, and every segment is handled in the order it was sent.

docs/explanation/operations.md, "Replicas of every daemon". The counter service's handler stamps
each message with ``clock_timestamp()`` in the worker's transaction; a segment's messages
are sequential, so their stamps must follow the order of publication.
"""

from __future__ import annotations

import json
import random
import time

import pytest

from framework import names
from tests import support
from tests.acceptance.test_exactly_once import publish_in_background
from tests.apps import counter
from tests.apps.helpers import query, scalar
from txbox_tools.processes import Daemon, ProcessGroup

APP = ["--app", "tests.apps.counter:service"]
SEGMENTS = 20
MESSAGES = 3_000


@pytest.fixture
def env(database_url: str, amqp_url: str) -> dict[str, str]:
    return counter.daemon_env(database_url, amqp_url, **counter.SHORT_LEASE)


def consumers(amqp_url: str) -> int:
    import pika

    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        queue = names.inbox_queue(counter.SERVICE)
        return int(connection.channel().queue_declare(queue, passive=True).method.consumer_count)
    finally:
        connection.close()


@pytest.mark.slow
def test_replicas_killed_in_turn_keep_every_segment_in_order_exactly_once(
    database_url: str, amqp_url: str, env: dict[str, str], processes: ProcessGroup
) -> None:
    rng = random.Random(int(time.time()))
    bodies = [counter.envelope(n, aggregate_id=str(n % SEGMENTS)) for n in range(MESSAGES)]
    sent: dict[str, list[str]] = {}
    for body in bodies:
        message = json.loads(body)
        sent.setdefault(message["aggregate_id"], []).append(message["message_id"])
    started = 0

    def start(command: str) -> Daemon:
        nonlocal started
        started += 1
        return processes.start(f"{command}-{started}", [command, *APP], env=env)

    replicas = {name: start(name.split("-")[0]) for name in ("receiver-a", "receiver-b", "worker-a", "worker-b")}
    support.wait_until(lambda: consumers(amqp_url) == 1, 60, message="one receiver consuming")
    sender = publish_in_background(amqp_url, bodies, chunk=250)
    kills = 0
    while sender.is_alive() or kills < 6:
        support.pause(rng.uniform(0.5, 1.5))  # a random moment, not a synchronization
        # Receivers first: the consuming one is killed at least every other time.
        name = rng.choice(("receiver-a", "receiver-b") if kills % 2 == 0 else tuple(replicas))
        processes.kill(replicas[name])
        replicas[name] = start(name.split("-")[0])
        kills += 1
        assert consumers(amqp_url) <= 1, "two receivers consumed the inbox queue at once"

    def settled() -> bool:
        return bool(
            scalar(
                database_url,
                "SELECT count(*) = %s AND bool_and(processed_at IS NOT NULL) FROM txbox.inbox",
                (MESSAGES,),
            )
        )

    logs = lambda: "\n".join(f"--- {d.name}\n{d.log_tail(10)}" for d in replicas.values())  # noqa: E731
    support.wait_until(settled, 240, interval=0.5, message=f"every message handled\n{logs()}")
    counts = dict(query(database_url, "SELECT id::text, n FROM counters"))
    assert len(counts) == MESSAGES and set(counts.values()) == {1}, "every message exactly once"
    handled = query(
        database_url,
        "SELECT i.aggregate_id, c.id::text FROM counters c JOIN txbox.inbox i ON i.id = c.id ORDER BY c.handled_at",
    )
    order: dict[str, list[str]] = {}
    for segment, message_id in handled:
        order.setdefault(segment, []).append(message_id)
    wrong = [segment for segment, ids in sent.items() if order.get(segment) != ids]
    assert not wrong, f"segments handled out of order: {wrong}"
