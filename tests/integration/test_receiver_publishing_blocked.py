"""A broker that blocks publishers does not stop the receiver consuming
(docs/explanation/receive.md, "Publishing blocked by the broker").

A private RabbitMQ node raises its memory alarm (``set_vm_memory_high_watermark 0``):
RabbitMQ then blocks every connection that publishes and keeps delivering on those that
only consume. Some deliveries need a copy published (their inbox INSERT fails as if the
database were unavailable, so they go to the delay chain): they must wait unacked while
every other delivery is stored and acked; once the alarm clears, they go round the chain
and are stored too, each exactly once.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pika
import pytest
from prometheus_client import REGISTRY

from framework import metrics, names, topology
from framework.receiver import Receiver, ReceiverConfig
from framework.service import Service
from framework.settings import Settings
from tests import support
from tests.apps.helpers import encode, place_order, publish, query, queue_depth, running, scalar
from txbox_tools.chaos.instances import PrivateRabbit, free_port

CONTRACTS = Path(__file__).resolve().parents[2] / "contracts"
SERVICE = "order-service"

# Rows of the ids in ``unavailable`` fail to insert with SQLSTATE 53100 (disk_full), an
# error of the database, not of the message: the receiver sends them round the delay chain.
_UNAVAILABLE = """
CREATE TABLE public.unavailable (id uuid PRIMARY KEY);
CREATE FUNCTION public.refuse_unavailable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM public.unavailable WHERE id = NEW.id) THEN
        RAISE EXCEPTION 'the test makes this row unstorable for now' USING ERRCODE = '53100';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER refuse_unavailable BEFORE INSERT ON txbox.inbox
    FOR EACH ROW EXECUTE FUNCTION public.refuse_unavailable();
"""


@pytest.fixture
def private_rabbit() -> Iterator[PrivateRabbit]:
    """A node of this test's own: its alarm blocks nobody else's publishers."""
    with PrivateRabbit(management=False, small=True) as node:
        yield node


def _take_back(amqp_url: str, count: int) -> None:
    """Get ``count`` deliveries and close without acking: the broker requeues them as redelivered.

    The receiver settles redelivered deliveries one at a time ("Receiver intake"), so
    exactly the held ones need a copy, not the batches they would share with free ones.
    """
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        channel = connection.channel()
        for _ in range(count):
            method, _props, _body = channel.basic_get(names.inbox_queue(SERVICE))
            assert method is not None
    finally:
        connection.close()


def _unacked(node: PrivateRabbit) -> int:
    out = node.ctl("list_queues", "-q", "--no-table-headers", "name", "messages_unacknowledged")
    counts = dict(line.split("\t") for line in out.splitlines() if "\t" in line)
    return int(counts.get(names.inbox_queue(SERVICE), -1))


def _copies_connections(node: PrivateRabbit, what: str) -> int:
    """The receiver's publishing connections: ``blocked`` counts those blocked now; an Erlang
    call on ``P`` (say ``close_connection(P, "why")``) runs on each and counts them."""
    name = f"{SERVICE} receiver copies"
    match = (
        "P <- rabbit_networking:connections(), "
        "[{client_properties, Props}, {state, State}] <- "
        "[rabbit_networking:connection_info(P, [client_properties, state])], "
        f'lists:member({{<<"connection_name">>, longstr, <<"{name}">>}}, Props)'
    )
    if what == "blocked":
        expression = f"length([P || {match}, State =:= blocked])."
    else:
        expression = f"length([rabbit_networking:{what} || {match}])."
    return int(node.ctl("eval", expression).strip())


def _gauge(name: str) -> float:
    return REGISTRY.get_sample_value(name, metrics.labels(SERVICE)) or 0.0


def test_consuming_goes_on_while_the_broker_blocks_publishing(database_url: str, private_rabbit: PrivateRabbit) -> None:
    amqp_url = private_rabbit.amqp_url()
    # A node that is down first in the list: both of the receiver's connections fail over.
    cluster_url = f"amqp://guest:guest@127.0.0.1:{free_port()}/%2F,{amqp_url}"
    settings = Settings(service=SERVICE, database_url=database_url, amqp_url=cluster_url, contracts_dir=CONTRACTS)
    service = Service(settings=settings)
    topology.declare(settings, service.registry)
    query(database_url, _UNAVAILABLE)
    held = [place_order(aggregate_id=f"held-{i}") for i in range(3)]
    free = [place_order(aggregate_id=f"free-{i}") for i in range(12)]
    query(database_url, "INSERT INTO public.unavailable SELECT unnest(%s::uuid[])", ([m["message_id"] for m in held],))
    # Each held delivery ahead of free ones: a receiver stuck on its copy stores none of those.
    order = [held[0], *free[:4], held[1], *free[4:8], held[2], *free[8:]]
    publish(amqp_url, [encode(m) for m in order])  # before the alarm, which would block this publisher
    _take_back(amqp_url, len(order))
    private_rabbit.ctl("set_vm_memory_high_watermark", "0")

    def stored() -> set[str]:
        return {str(row[0]) for row in query(database_url, "SELECT id FROM txbox.inbox")}

    delayed = metrics.RECEIVER_DELAYED.labels(**metrics.labels(SERVICE))._value.get()
    config = ReceiverConfig(batch_size=1, prefetch=50, retry_schedule="1s*3", db_connect_timeout=2)
    with running(Receiver(service, config)):
        support.wait_until(
            lambda: stored() == {m["message_id"] for m in free}, 20, message="the free deliveries stored"
        )
        support.wait_until(
            lambda: _gauge("txbox_receiver_copies_waiting_messages") == len(held), 30, message="held copies waiting"
        )
        # RabbitMQ sends Connection.Blocked when the connection first publishes under the
        # alarm: the copies can be waiting a moment before the frame reaches the receiver.
        support.wait_until(
            lambda: _gauge("txbox_receiver_publishing_blocked_seconds") > 0, 20, message="the block is reported"
        )
        # A quorum queue's counts are refreshed on its tick (seconds): wait for the figure to settle.
        support.wait_until(
            lambda: _unacked(private_rabbit) == len(held), 20, message="the held deliveries unacked, the rest acked"
        )
        assert metrics.RECEIVER_DELAYED.labels(**metrics.labels(SERVICE))._value.get() == delayed, (
            "no copy confirmed yet"
        )

        # The publishing connection is lost while its copies wait: they go again on a new
        # one (blocked in turn), never dropped, their deliveries still unacked.
        assert _copies_connections(private_rabbit, 'close_connection(P, "test")') == 1
        support.wait_until(
            lambda: _copies_connections(private_rabbit, "blocked") == 1, 20, message="the copies on a new connection"
        )
        assert _gauge("txbox_receiver_copies_waiting_messages") == len(held)
        assert stored() == {m["message_id"] for m in free}, "all of it while publishing stays blocked"

        query(database_url, "DELETE FROM public.unavailable")
        private_rabbit.ctl("set_vm_memory_high_watermark", "0.4")
        support.wait_until(
            lambda: stored() == {m["message_id"] for m in (*held, *free)}, 30, message="every message stored"
        )
        support.wait_until(lambda: _gauge("txbox_receiver_copies_waiting_messages") == 0, 10, message="no copy waiting")
        assert _gauge("txbox_receiver_publishing_blocked_seconds") == 0, "unblocked"
    attempts = dict(
        query(database_url, "SELECT id::text, (metadata->'properties'->'headers'->>%s)::int FROM txbox.inbox",
              (names.HEADER_ATTEMPT,))
    )  # fmt: skip
    assert {attempts[m["message_id"]] for m in held} == {2}, "the held ones went round the delay chain once"
    assert {attempts[m["message_id"]] for m in free} == {None}, "the free ones were stored at once"
    assert scalar(database_url, "SELECT count(*) FROM txbox.dead_letters") == 0
    assert queue_depth(amqp_url, names.inbox_queue(SERVICE)) == 0
    assert queue_depth(amqp_url, names.dead_letter_queue(SERVICE)) == 0
