"""`txbox analyze` over seeded databases: every count and every id is exactly right."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest

from framework.analytics.job import run_once
from framework.analytics.settings import AnalyzeSettings
from framework.analytics.sources import Source
from framework.contracts import Registry, load_registry
from framework.db import conninfo
from tests.spark.seed import Seeder, at

ROOT = Path(__file__).resolve().parents[2]
ORDER, INVENTORY = "order-service", "inventory-service"
SETTINGS = AnalyzeSettings(grace=300, sla=900, window=86400, partition_rows=5)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def registry() -> Registry:
    return load_registry(ROOT / "contracts")


@dataclass
class World:
    now: datetime
    order_url: str
    inventory_url: str
    ids: dict[str, set[str]] = field(default_factory=dict)

    def add(self, kind: str, mid: uuid.UUID | str) -> None:
        self.ids.setdefault(kind, set()).add(str(mid))


def seed(order_url: str, inventory_url: str, registry: Registry) -> World:
    now = datetime.now(UTC)
    w = World(now=now, order_url=order_url, inventory_url=inventory_url)
    order, inv = Seeder(order_url, registry, ORDER), Seeder(inventory_url, registry, INVENTORY)
    hour = at(now, -3600)
    try:
        _seed_deliveries(w, order, inv, hour)
        _seed_failures(w, order, inv, hour)
        _seed_the_rest(w, order, inv, hour)
    finally:
        order.close()
        inv.close()
    return w


def _seed_deliveries(w: World, order: Seeder, inv: Seeder, hour: datetime) -> None:
    """order → inventory: delivered, lost, in flight, late, redelivered."""
    now = w.now
    # Delivered and processed: created → published 1 s, → received 2 s, → processed 3 s.
    for i in range(3):
        t = at(hour, i)
        mid = order.outbox("OrderPlaced", t, processed_at=at(t, 1))
        inv.inbox("OrderPlaced", mid, t, at(t, 3), processed_at=at(t, 6))
        w.add("delivered", mid)
    # Lost: published an hour ago, in neither the inbox nor the dead letters of inventory.
    for i in range(2):
        w.add("lost", order.outbox("OrderPlaced", at(hour, 10 + i), processed_at=at(hour, 11 + i)))
    # In flight: published 10 s ago, not received yet (within the 5 min grace).
    w.add("in_flight", order.outbox("OrderPlaced", at(now, -12), processed_at=at(now, -10)))
    # Late but delivered: received 30 min after publishing; not lost.
    t = at(hour, 20)
    late = order.outbox("OrderPlaced", t, processed_at=at(t, 1))
    inv.inbox("OrderPlaced", late, t, at(t, 1801), processed_at=at(t, 1802))
    w.add("late", late)
    # Duplicate delivery: stored once (inbox dedup), counted three times by the receiver.
    t = at(hour, 30)
    dup = order.outbox("OrderPlaced", t, processed_at=at(t, 1))
    inv.inbox("OrderPlaced", dup, t, at(t, 3), processed_at=at(t, 6), redelivered=True)
    inv.redelivery(dup, 3, at(t, 3))
    w.add("redelivered", dup)


def _seed_failures(w: World, order: Seeder, inv: Seeder, hour: datetime) -> None:
    """Rejected, abandoned, discarded and stuck messages."""
    now = w.now
    # Rejected by the receiver of inventory: a dead letter there, not lost.
    t = at(hour, 40)
    rejected = order.outbox("OrderPlaced", t, processed_at=at(t, 1))
    inv.dead_letter(rejected, "OrderPlaced", at(t, 2), source="inbox", reason="schema_invalid", error="bad 'x'")
    w.add("abandoned", rejected)
    # Abandoned by inventory's worker after 3 attempts.
    t = at(hour, 50)
    poisoned = order.outbox("OrderPlaced", t, processed_at=at(t, 1))
    inv.inbox("OrderPlaced", poisoned, t, at(t, 2), abandoned_at=at(t, 60), started=3, finished=3, last_error="boom")
    w.ids["fp_max_attempts"] = {inv.dead_letter(poisoned, "OrderPlaced", at(t, 60))}
    w.add("abandoned", poisoned)
    w.add("poisoned", poisoned)
    # A dead letter already discarded: counted in fingerprints, not a finding.
    t = at(hour, 55)
    discarded = order.outbox("OrderPlaced", t, processed_at=at(t, 1))
    inv.inbox("OrderPlaced", discarded, t, at(t, 2), abandoned_at=at(t, 9), started=1, finished=1)
    inv.dead_letter(discarded, "OrderPlaced", at(t, 9), discarded=True)
    w.add("discarded", discarded)
    # Stuck: never published (publisher down), and one leased long ago by a live lease.
    w.add("stuck", order.outbox("OrderPlaced", at(hour, 60)))
    w.add(
        "stuck",
        order.outbox("OrderPlaced", at(hour, 61), started=1, finished=0, locked_until=at(now, 30)),
    )
    # Not stuck: scheduled for tomorrow, and one created a minute ago.
    order.outbox("OrderPlaced", at(hour, 62), locked_until=at(now, 86400))
    order.outbox("OrderPlaced", at(now, -60))
    # Stuck in inventory's inbox: received, worker crashed holding the lease.
    t = at(hour, 70)
    held = order.outbox("OrderPlaced", t, processed_at=at(t, 1))
    inv.inbox("OrderPlaced", held, t, at(t, 2), started=1, finished=0, locked_until=at(t, 32))
    w.add("stuck", held)


def _seed_the_rest(w: World, order: Seeder, inv: Seeder, hour: datetime) -> None:
    """A type nobody subscribes to, inventory → order, and unexpected inbox rows."""
    # OrderCompleted: nobody subscribes — never lost.
    order.outbox("OrderCompleted", at(hour, 80), processed_at=at(hour, 81))
    # inventory → order: StockReserved delivered, StockRejected lost.
    t = at(hour, 90)
    reserved = inv.outbox("StockReserved", t, processed_at=at(t, 1))
    order.inbox("StockReserved", reserved, t, at(t, 2), processed_at=at(t, 3))
    w.add("lost", inv.outbox("StockRejected", at(hour, 95), processed_at=at(hour, 96)))
    # Unexpected in inventory's inbox: an OrderPlaced no source published, an unknown type,
    # and in order's inbox a PlaceOrder command from outside (no outbox has it).
    for kind, mtype, seeder in (
        ("not_in_publisher_outbox", "OrderPlaced", inv),
        ("unknown_message_type", "SomethingForeign", inv),
        ("no_source_outbox_has_it", "PlaceOrder", order),
    ):
        mid = uuid.uuid4()
        t = at(hour, 100)
        seeder.inbox(mtype, mid, t, at(t, 1), processed_at=at(t, 2))
        w.add("unexpected", mid)
        w.add(kind, mid)


@pytest.fixture(scope="module")
def world(registry: Registry, template_db: str, spark: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Two service databases seeded once for the module (the Spark run is the slow part)."""
    from tests import support

    names = [support.unique("txbox_s") for _ in range(2)]
    for n in names:
        support.create_database(n, template=template_db)
    try:
        w = seed(support.db_url(names[0]), support.db_url(names[1]), registry)
        parquet = tmp_path_factory.mktemp("report")
        result = run_once(
            spark,
            sources=[Source(ORDER, w.order_url), Source(INVENTORY, w.inventory_url)],
            registry=registry,
            settings=SETTINGS,
            report_url=w.order_url,
            parquet=parquet,
        )
        rows = fetch(w.order_url, result.run_id)
        yield w, result, rows, parquet
    finally:
        for n in names:
            support.drop_database(n)


def fetch(url: str, run_id: str) -> dict[str, list[dict[str, Any]]]:
    tables = (
        "analytics_runs",
        "analytics_findings",
        "analytics_latency",
        "analytics_throughput",
        "analytics_attempts",
        "analytics_message_types",
        "analytics_fingerprints",
        "analytics_dead_letter_trend",
    )
    out: dict[str, list[dict[str, Any]]] = {}
    with psycopg.connect(conninfo(url), row_factory=psycopg.rows.dict_row) as conn:
        for t in tables:
            out[t] = conn.execute(f"SELECT * FROM txbox.{t} WHERE run_id = %s", (run_id,)).fetchall()
    return out


def ids_of(rows: list[dict[str, Any]], kind: str, **where: Any) -> set[str]:
    return {r["message_id"] for r in rows if r["kind"] == kind and all(r[k] == v for k, v in where.items())}


def test_lost_messages_are_exactly_the_unreceived_ones(world: Any) -> None:
    w, result, rows, _ = world
    findings = rows["analytics_findings"]
    assert ids_of(findings, "lost") == w.ids["lost"]
    assert result.counts["lost"] == 3 == rows["analytics_runs"][0]["lost"]
    lost_to = {r["message_id"]: (r["publisher"], r["service"]) for r in findings if r["kind"] == "lost"}
    stock_rejected = next(r for r in findings if r["kind"] == "lost" and r["message_type"] == "StockRejected")
    assert lost_to[stock_rejected["message_id"]] == (INVENTORY, ORDER)
    assert ids_of(findings, "in_flight") == w.ids["in_flight"]
    # Late, duplicated and rejected messages are not lost.
    for kind in ("late", "redelivered", "abandoned", "delivered"):
        assert not (ids_of(findings, "lost") & w.ids[kind])


def test_stuck_abandoned_unexpected_redelivered(world: Any) -> None:
    w, result, rows, _ = world
    findings = rows["analytics_findings"]
    assert ids_of(findings, "stuck") == w.ids["stuck"]
    states = {r["message_id"]: r["state"] for r in findings if r["kind"] == "stuck"}
    assert sorted(states.values()) == ["lease_expired", "leased", "pending"]
    assert ids_of(findings, "abandoned") == w.ids["abandoned"]
    assert {r["reason"] for r in findings if r["kind"] == "abandoned"} == {"schema_invalid", "max_attempts"}
    assert ids_of(findings, "unexpected") == w.ids["unexpected"]
    for reason in ("not_in_publisher_outbox", "unknown_message_type", "no_source_outbox_has_it"):
        assert ids_of(findings, "unexpected", reason=reason) == w.ids[reason]
    assert ids_of(findings, "redelivered") == w.ids["redelivered"]
    assert next(r["count"] for r in findings if r["kind"] == "redelivered") == 3
    run = rows["analytics_runs"][0]
    assert (run["stuck"], run["abandoned"], run["unexpected"], run["redelivered"], run["in_flight"]) == (3, 2, 3, 1, 1)
    assert result.counts == {"lost": 3, "in_flight": 1, "stuck": 3, "abandoned": 2, "unexpected": 3, "redelivered": 1}


def test_latency_per_stage(world: Any) -> None:
    _, _, rows, _ = world
    lat = {(r["service"], r["message_type"], r["stage"]): r for r in rows["analytics_latency"]}
    # 3 regular + late + duplicate + the stray are processed in inventory.
    e2e = lat[(INVENTORY, "OrderPlaced", "end_to_end")]
    assert e2e["samples"] == 6
    assert e2e["p50_ms"] == pytest.approx(6000, abs=1)
    assert e2e["max_ms"] == pytest.approx(1802000, abs=1)
    rec = lat[(INVENTORY, "OrderPlaced", "published_received")]
    assert rec["publisher"] == ORDER
    assert rec["samples"] == 8
    assert rec["p50_ms"] == pytest.approx(2000, abs=1)
    assert lat[(INVENTORY, "OrderPlaced", "received_processed")]["p50_ms"] == pytest.approx(3000, abs=1)
    assert lat[(ORDER, "OrderPlaced", "created_published")]["p50_ms"] == pytest.approx(1000, abs=1)


def test_attempts_failures_fingerprints_and_trend(world: Any) -> None:
    w, _, rows, _ = world
    types = {(r["service"], r["side"], r["message_type"]): r for r in rows["analytics_message_types"]}
    inv = types[(INVENTORY, "inbox", "OrderPlaced")]
    # 6 processed (3 + late + dup + the stray), 2 abandoned (poisoned after 3 attempts,
    # discarded after 1), 1 pending (the expired lease).
    assert (inv["processed"], inv["abandoned"], inv["pending"]) == (6, 2, 1)
    assert inv["failed_attempts"] == 4
    assert inv["abandon_rate"] == pytest.approx(2 / 8)
    attempts = {
        r["attempts"]: r["messages"]
        for r in rows["analytics_attempts"]
        if (r["service"], r["side"], r["message_type"]) == (INVENTORY, "inbox", "OrderPlaced")
    }
    assert attempts == {1: 7, 3: 1}
    fps = {r["fingerprint"]: r for r in rows["analytics_fingerprints"]}
    (fp,) = w.ids["fp_max_attempts"]
    assert fps[fp]["dead_letters"] == 2 and fps[fp]["open"] == 1
    assert set(fps[fp]["message_ids"].split(",")) == w.ids["poisoned"] | w.ids["discarded"]
    assert sum(r["dead_letters"] for r in rows["analytics_dead_letter_trend"]) == 3
    created = sum(
        r["messages"]
        for r in rows["analytics_throughput"]
        if (r["service"], r["message_type"], r["event"]) == (ORDER, "OrderPlaced", "created")
    )
    assert created == 16


def test_parquet_output_and_summary(world: Any, spark: Any) -> None:
    _, result, rows, parquet = world
    df = spark.read.parquet(str(parquet / "analytics_findings"))
    assert df.where(f"run_id = '{result.run_id}'").count() == len(rows["analytics_findings"])
    text = result.summary()
    assert "lost         3" in text
    for mid in sorted(world[0].ids["lost"]):
        assert mid in text


def test_only_sources_are_judged(registry: Registry, make_database: Callable[[], str], spark: Any) -> None:
    order_url, inventory_url = make_database(), make_database()
    w = seed(order_url, inventory_url, registry)
    result = run_once(spark, sources=[Source(ORDER, w.order_url)], registry=registry, settings=SETTINGS)
    # Inventory's database was not read: nothing sent to it can be judged lost, and what it
    # published is unknown (so StockReserved in order's inbox has no known publisher).
    assert result.lost == 0
    assert any("not judged" in n and f"to {INVENTORY}" in n for n in result.notes)
    assert result.counts["unexpected"] == 2  # StockReserved (publisher not a source) + PlaceOrder
    assert result.counts["stuck"] == 2
