"""A RabbitMQ node that dies for good: the service consumes again, exactly once, in order.

A private three-node cluster; the counter service runs with all three URLs in
TXBOX_AMQP_URL, as ``txbox run`` or as separate daemons with two receivers. The node the
consuming receiver is connected to — it also leads the inbox queue, which that receiver
declared (quorum queues are led by the declaring node) — is killed with ``kill -9``
after the first half of the commands and never started again; a plain pika client
publishes everything to the surviving nodes. The quorum queue keeps counting the dead
node's consumer until that node returns, so a rule that waits for the queue to show no
other consumer never consumes again (docs/explanation/operations.md, "A RabbitMQ cluster"). Every
message must be handled exactly once, each segment in the order it was published. The
time from the kill to the first message of the second half handled is printed, never
asserted (the generous wait below only bounds the test).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pika
import pytest

from framework import names
from tests import support
from tests.apps import counter
from tests.apps.helpers import publish, query, scalar
from txbox_tools.chaos.instances import PrivateRabbit, PrivateRabbitCluster
from txbox_tools.processes import Daemon, ProcessGroup

pytestmark = pytest.mark.slow

APP = ["--app", "tests.apps.counter:service"]
QUEUE = names.inbox_queue(counter.SERVICE)
MESSAGES = 300
SEGMENTS = 10
# Far above the takeover bound the README states; only the test's own limit.
RECOVERY_WAIT = 150.0


@pytest.fixture
def cluster() -> Iterator[PrivateRabbitCluster]:
    with PrivateRabbitCluster(3) as rabbit:
        yield rabbit


def consuming_node(cluster: PrivateRabbitCluster) -> PrivateRabbit | None:
    """The node whose connection holds the inbox queue's one live consumer (None unless exactly one)."""
    consumers = [c for c in cluster.api("GET", "/consumers") or [] if (c.get("queue") or {}).get("name") == QUEUE]
    if len(consumers) != 1:
        return None
    node = (consumers[0].get("channel_details") or {}).get("node")
    return next((n for n in cluster.nodes if n.node == node), None)


def handled(database_url: str) -> int:
    return int(scalar(database_url, "SELECT count(*) FROM counters") or 0)


def environment(database_url: str, cluster: PrivateRabbitCluster) -> dict[str, str]:
    """The daemons' environment; the topology is left to the daemons, so the first one to
    declare the inbox queue places its leader on its own node."""
    query(database_url, counter.TABLE)
    return {
        "TXBOX_DATABASE_URL": database_url,
        "TXBOX_AMQP_URL": cluster.amqp_url(),
        "TXBOX_QUEUE_TYPE": "quorum",
        **counter.SHORT_LEASE,
    }


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", ["txbox run", "separate daemons"])
def test_losing_the_consuming_node_for_good_keeps_every_segment_exactly_once_in_order(
    layout: str, cluster: PrivateRabbitCluster, database_url: str, processes: ProcessGroup
) -> None:
    env = environment(database_url, cluster)
    daemons: list[Daemon] = []
    if layout == "txbox run":
        daemons.append(processes.start("run", ["run", *APP], env=env))
    else:
        # The first receiver declares the queue alone, so it consumes where the queue is led.
        daemons.append(processes.start("receiver-a", ["receiver", *APP], env=env))
    logs = lambda: "\n".join(f"--- {d.name}\n{d.log_tail(30)}" for d in daemons)  # noqa: E731
    doomed = support.wait_until(lambda: consuming_node(cluster), 120, message=f"a receiver consuming\n{logs()}")
    if layout == "separate daemons":
        daemons += [
            processes.start("receiver-b", ["receiver", *APP], env=env),
            processes.start("worker", ["worker", *APP], env=env),
        ]
        support.wait_until(
            lambda: "standby" in daemons[1].log_tail(100_000), 120, message=f"the second receiver stands by\n{logs()}"
        )
    leader = cluster.leader(QUEUE)
    survivor = next(node for node in cluster.nodes if node is not doomed)

    bodies = [counter.envelope(n, aggregate_id=str(n % SEGMENTS)) for n in range(MESSAGES)]
    sent: dict[str, list[str]] = {}
    for body in bodies:
        message = json.loads(body)
        sent.setdefault(message["aggregate_id"], []).append(message["message_id"])
    first, second = bodies[: MESSAGES // 2], bodies[MESSAGES // 2 :]
    publish(survivor.amqp_url(), first, routing_key=counter.ROUTING_KEY)
    support.wait_until(lambda: handled(database_url) == len(first), 120, message=f"the first half handled\n{logs()}")

    killed_at = time.time()
    doomed.kill()  # kill -9, never started again
    support.wait_until(
        lambda: publish_or_none(survivor.amqp_url(), second), 120, message="publishing to the surviving nodes"
    )
    support.wait_until(
        lambda: handled(database_url) > len(first),
        RECOVERY_WAIT,
        interval=0.2,
        message=f"a message handled after losing {doomed.node} for good\n{logs()}",
    )
    support.wait_until(
        lambda: handled(database_url) == MESSAGES, 120, interval=0.2, message=f"every message handled\n{logs()}"
    )
    resumed = scalar(
        database_url,
        "SELECT extract(epoch FROM min(c.handled_at)) FROM counters c WHERE c.id = ANY(%s::uuid[])",
        ([json.loads(body)["message_id"] for body in second],),
    )
    print(
        f"\n{layout}: killed {doomed.node} (leader of {QUEUE}: {leader is doomed}) for good; "
        f"first message published after the kill handled {float(resumed) - killed_at:.1f}s after it"
    )
    assert all(d.alive for d in daemons), logs()

    counts = dict(query(database_url, "SELECT id::text, n FROM counters"))
    assert len(counts) == MESSAGES and set(counts.values()) == {1}, "every message exactly once"
    rows = query(
        database_url,
        "SELECT i.aggregate_id, c.id::text FROM counters c JOIN txbox.inbox i ON i.id = c.id ORDER BY c.handled_at",
    )
    order: dict[str, list[str]] = {}
    for segment, message_id in rows:
        order.setdefault(segment, []).append(message_id)
    wrong = [segment for segment, ids in sent.items() if order.get(segment) != ids]
    assert not wrong, f"segments handled out of order: {wrong}"


def publish_or_none(url: str, bodies: list[bytes]) -> bool:
    """Publish with confirms; False while the cluster still elects the queue's new leader."""
    try:
        publish(url, bodies, routing_key=counter.ROUTING_KEY)
    except (pika.exceptions.AMQPError, OSError):
        return False
    return True
