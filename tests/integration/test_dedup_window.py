"""`txbox archive --older-than 0s` does not re-open the door to a double apply.

The duplicate is published with plain pika to the service's inbox queue after the
archive, and the real receiver and worker run: the business table shows how often the
handler ran.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

from framework import CommandHandler, Message, Outbox, names, topology
from framework.cli import main as txbox
from framework.receiver import Receiver, ReceiverConfig
from framework.service import Service
from framework.worker import Worker, WorkerConfig
from tests import support
from tests.apps.helpers import encode, place_order, publish, query, queue_depth, running, scalar

QUEUE = names.inbox_queue("order-service")


class Seen(CommandHandler):
    message_type = "PlaceOrder"

    def handle(self, message: Message, session: Session, outbox: Outbox) -> None:
        session.execute(text("INSERT INTO seen (id) VALUES (:id)"), {"id": message.message_id})


def _times_applied(url: str, message_id: str) -> int:
    return int(scalar(url, "SELECT count(*) FROM seen WHERE id = %s", (message_id,)))


def _deliver_and_process(service: Service, url: str, bodies: list[bytes], marker: str) -> None:
    """Publish ``bodies`` (the marker last), run receiver and worker until the marker ran."""
    publish(service.settings.amqp_url, bodies)
    with (
        running(Receiver(service, ReceiverConfig(prefetch=50, batch_size=10))),
        running(Worker(service, WorkerConfig(poll_interval=0.1))),
    ):
        support.wait_until(lambda: _times_applied(url, marker) == 1, 30, message="the marker message processed")
        # One receiver takes the queue in order: the marker stored means every copy before it was settled.
        support.wait_until(
            lambda: queue_depth(service.settings.amqp_url, QUEUE) == 0, 15, message="every delivery acked"
        )
        pending = "SELECT count(*) FROM txbox.inbox WHERE processed_at IS NULL AND abandoned_at IS NULL"
        support.wait_until(lambda: scalar(url, pending) == 0, 15, message="nothing left pending")


@pytest.mark.parametrize("older_than", ["0s", "1h"])
def test_a_duplicate_after_the_archive_is_not_applied_again(
    service: Service, database_url: str, tmp_path: Path, older_than: str, capsys: Any, spark: Any
) -> None:
    query(database_url, "CREATE TABLE seen (n bigserial PRIMARY KEY, id uuid NOT NULL)")
    service.register(Seen())
    topology.declare(service.settings, service.registry)
    message = place_order()
    first = place_order()
    _deliver_and_process(service, database_url, [encode(message), encode(first)], first["message_id"])
    assert _times_applied(database_url, message["message_id"]) == 1
    if older_than == "1h":  # received long ago, processed within the window
        query(database_url, "UPDATE txbox.inbox SET created_at = created_at - interval '2 hours'")

    rc = txbox(
        [
            "archive",
            "--older-than",
            older_than,
            "--to",
            str(tmp_path),
            "--service",
            "order-service",
            "--database-url",
            database_url,
        ]
    )

    assert rc == 0
    summary = capsys.readouterr().out
    second = place_order()
    _deliver_and_process(
        service, database_url, [encode(message), encode(message), encode(second)], second["message_id"]
    )
    assert _times_applied(database_url, message["message_id"]) == 1, "the duplicate was applied again"
    assert scalar(database_url, "SELECT count(*) FROM txbox.dead_letters") == 0  # a quiet duplicate
    assert "inbox: 2 archived, 0 deleted, 2 kept as ids for dedup" in summary
    tombstone = "SELECT archived_at IS NOT NULL AND payload = '{}'::jsonb FROM txbox.inbox WHERE id = %s"
    assert scalar(database_url, tombstone, (message["message_id"],)) is True


def test_the_dedup_window_is_validated_at_start(
    database_url: str, tmp_path: Path, capsys: Any, monkeypatch: Any
) -> None:
    monkeypatch.setenv("TXBOX_DEDUP_WINDOW", "0s")
    rc = txbox(
        ["archive", "--older-than", "0s", "--to", str(tmp_path), "--service", "s", "--database-url", database_url]
    )
    assert rc == 2
    err = capsys.readouterr().err
    assert "TXBOX_DEDUP_WINDOW" in err and "Example: TXBOX_DEDUP_WINDOW=7d" in err
    assert scalar(database_url, "SELECT count(*) FROM txbox.inbox") == 0
    assert not list(tmp_path.iterdir())


def test_the_archive_keeps_ids_inside_the_window_deletes_the_rest_and_archives_each_row_once(
    database_url: str, tmp_path: Path, spark: Any
) -> None:
    import pyarrow.dataset as ds

    from framework.analytics.archive import Archiver

    ages = {"inside": "1 day", "outside": "10 days", "abandoned": "2 days"}
    ids = {}
    for name, age in ages.items():
        done = "abandoned_at" if name == "abandoned" else "processed_at"
        ids[name] = str(
            scalar(
                database_url,
                f"""INSERT INTO txbox.inbox (id, message_type, aggregate_type, aggregate_id, kind, routing_key, payload,
                       metadata, segment, message_timestamp, queue, created_at, {done}, last_error)
                    VALUES (gen_random_uuid(), 'PlaceOrder', 'order', %(name)s, 'command', 'order-service.order.place',
                       jsonb_build_object('quantity', 1, 'customer', %(name)s::text), '{{"auth_token": "t"}}', %(name)s,
                       now(), 'order-service:inbox', now() - %(age)s::interval, now() - %(age)s::interval, 'boom')
                    RETURNING id""",
                {"name": name, "age": age},
            )
        )

    def archive() -> Any:
        return Archiver(
            database_url=database_url, service="order-service", root=tmp_path, batch_size=2, spark=spark
        ).run(timedelta(0))

    first, second = archive(), archive()

    rows = dict(query(database_url, "SELECT id::text, archived_at IS NOT NULL FROM txbox.inbox"))
    assert rows == {ids["inside"]: True, ids["abandoned"]: True}
    stripped = query(
        database_url,
        "SELECT payload, message_context, metadata ? 'auth_token', last_error, metadata ->> 'payload_sha256' "
        "FROM txbox.inbox",
    )
    assert all(r[0] == {} and r[1] == {} and r[2] is False and r[3] is None and len(r[4]) == 64 for r in stripped)
    files = ds.dataset(tmp_path / "order-service" / "inbox", format="parquet", partitioning="hive").to_table()
    archived = dict(zip(files["id"].to_pylist(), files["payload"].to_pylist(), strict=True))
    assert sorted(archived) == sorted(ids.values()), "each row archived once, with its content"
    assert all('"customer"' in p for p in archived.values())
    assert (first.tombstoned, first.deleted["inbox"], second.batches, second.purged) == (2, 1, 0, 0)
