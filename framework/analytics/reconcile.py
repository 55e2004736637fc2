"""Reconciliation: which messages are lost, stuck, abandoned, unexpected or redelivered.

The contracts say who should receive each message (``Registry.subscribers``); the
outboxes say what was published; the inboxes and dead letters say what arrived. Only
services whose database is a source can be judged: a subscriber that is not a source is
counted as "not judged" in the run's notes, never reported as lost.

Every finding is one row per message id, so a person can act on it
(``txbox dlq show <id>``, or look the row up in the outbox/inbox).

Tenants (docs/how-to/tenants.md, "Analyze every tenant"): a message a tenant of one service
published is due at the same tenant of each subscriber that is read per tenant (at any
tenant when its publisher has none, at the one database of a subscriber without tenants);
one found in another tenant's inbox is ``unexpected``, reason ``other_tenant``, besides
``lost`` where it was due. A finding's ``tenant`` is the tenant it concerns.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING

from framework.analytics.read import Frames
from framework.analytics.session import local_frame
from framework.contracts import Registry

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

LOST = "lost"
IN_FLIGHT = "in_flight"
STUCK = "stuck"
ABANDONED = "abandoned"
UNEXPECTED = "unexpected"
REDELIVERED = "redelivered"
KINDS = (LOST, IN_FLIGHT, STUCK, ABANDONED, UNEXPECTED, REDELIVERED)

FINDING_COLUMNS = (
    ("kind", "string"),
    ("service", "string"),
    ("tenant", "string"),
    ("publisher", "string"),
    ("message_type", "string"),
    ("message_id", "string"),
    ("state", "string"),
    ("reason", "string"),
    ("fingerprint", "string"),
    ("since", "timestamp"),
    ("age_seconds", "double"),
    ("count", "int"),
    ("detail", "string"),
)


@dataclass(frozen=True, kw_only=True)
class Judgement:
    as_of: datetime
    since: datetime
    grace_seconds: float
    sla_seconds: float


@dataclass
class Reconciliation:
    findings: DataFrame
    notes: list[str] = field(default_factory=list)


def _finding(df: DataFrame, as_of: datetime, **exprs: Column) -> DataFrame:
    """Shape ``df`` into the findings layout; columns not given are null."""
    from pyspark.sql import functions as F

    cols = []
    for name, type_ in FINDING_COLUMNS:
        if name == "age_seconds":
            expr = F.lit(as_of).cast("double") - exprs["since"].cast("double")
        else:
            expr = exprs.get(name, F.lit(None))
        cols.append(expr.cast(type_).alias(name))
    return df.select(*cols)


def _inbox_state() -> Column:
    """An inbox row's state as a finding shows it: processed, abandoned or pending."""
    from pyspark.sql import functions as F

    return (
        F.when(F.col("processed_at").isNotNull(), "processed")
        .when(F.col("abandoned_at").isNotNull(), "abandoned")
        .otherwise("pending")
    )


def contract_frames(spark: SparkSession, registry: Registry) -> tuple[DataFrame, DataFrame]:
    """(message_type → expected subscriber, message_type → kind and owner) from the contracts.

    Keyed by every name the registry answers to, aliases too, each resolved as the
    receiver resolves it (``Registry.get``): a row written under a type's old name, or
    by a sender that still uses it, is judged as the type it is an alias of.
    """
    known = [(name, registry.get(name)) for name in (*registry.messages, *registry.aliases)]
    expected = [(name, sub) for name, spec in known for sub in registry.subscribers(spec)]
    types = [(name, spec.kind, spec.service) for name, spec in known]
    return (
        local_frame(spark, expected, [("message_type", "string"), ("subscriber", "string")]),
        local_frame(spark, types, [("message_type", "string"), ("contract_kind", "string"), ("owner", "string")]),
    )


def reconcile(
    spark: SparkSession,
    frames: Frames,
    registry: Registry,
    services: list[str],
    judgement: Judgement,
    tenanted: Collection[str] = (),
) -> Reconciliation:
    """The findings of ``frames``; ``services`` are those read, ``tenanted`` those of them
    read per tenant."""
    from pyspark.sql import functions as F

    as_of = judgement.as_of
    expected, types = contract_frames(spark, registry)
    notes: list[str] = []

    # --- lost / in flight: published by A, in neither the inbox nor the dead letters of B
    # (of B's tenant that is A's, where B is read per tenant).
    published = frames.outbox.where(F.col("processed_at").isNotNull()).select(
        F.col("service").alias("publisher"),
        F.col("tenant").alias("publisher_tenant"),
        "id",
        "message_type",
        "processed_at",
    )
    due = published.join(F.broadcast(expected), "message_type").withColumn(
        "due_tenant", F.when(F.col("subscriber").isin(list(tenanted)), F.col("publisher_tenant"))
    )
    judged = due.where(F.col("subscriber").isin(services))
    # Why some published messages cannot be judged, in one Spark action.
    unjudged = (
        due.where(~F.col("subscriber").isin(services))
        .groupBy("publisher", "subscriber")
        .agg(F.count(F.lit(1)).alias("n"))
        .select("publisher", "subscriber", F.lit(None).cast("string").alias("message_type"), "n")
    )
    unknown = (
        published.join(F.broadcast(types), "message_type", "left_anti")
        .groupBy("publisher", "message_type")
        .agg(F.count(F.lit(1)).alias("n"))
        .select("publisher", F.lit(None).cast("string").alias("subscriber"), "message_type", "n")
    )
    for row in sorted(unjudged.unionByName(unknown).collect(), key=lambda r: (r["publisher"], str(r["subscriber"]))):
        if row["subscriber"] is not None:
            notes.append(
                f"not judged: {row['n']} message(s) from {row['publisher']} to {row['subscriber']} "
                f"({row['subscriber']} is not a source)"
            )
        else:
            notes.append(
                f"not judged: {row['n']} message(s) of type {row['message_type']} from {row['publisher']}: "
                "no contract declares the type"
            )
    arrived = frames.inbox.select(F.col("service").alias("at"), F.col("tenant").alias("at_tenant"), "id").unionByName(
        frames.dead_letters.where(F.col("message_id").isNotNull()).select(
            F.col("service").alias("at"), F.col("tenant").alias("at_tenant"), F.col("message_id").alias("id")
        )
    )
    # Where it was due: the subscriber, and the tenant if one is due (else any of its).
    where_due = (
        (judged["id"] == arrived["id"])
        & (judged["subscriber"] == arrived["at"])
        & (judged["due_tenant"].isNull() | (judged["due_tenant"] == arrived["at_tenant"]))
    )
    missing = judged.join(arrived, where_due, "left_anti")
    deadline = F.lit(as_of).cast("double") - F.lit(judgement.grace_seconds)
    late = F.col("processed_at").cast("double") >= deadline
    # One pass for both: the anti-joins above are the expensive part.
    lost = _finding(
        missing,
        as_of,
        kind=F.when(late, IN_FLIGHT).otherwise(LOST),
        service=F.col("subscriber"),
        tenant=F.coalesce(F.col("due_tenant"), F.col("publisher_tenant")),
        publisher=F.col("publisher"),
        message_type=F.col("message_type"),
        message_id=F.col("id"),
        state=F.lit("published"),
        reason=F.when(late, "within_grace").otherwise("not_in_subscriber_inbox"),
        since=F.col("processed_at"),
    )

    # --- stuck: pending or leased past the SLA (rows scheduled for later are not stuck).
    pending = F.col("processed_at").isNull() & F.col("abandoned_at").isNull()
    leased = F.col("started_attempts") > F.col("finished_attempts")
    future = F.col("locked_until") > F.lit(as_of)
    state = (
        F.when(leased & future, "leased")
        .when(leased, "lease_expired")
        .when((F.col("finished_attempts") > 0) & future, "backoff")
        .when(future, "scheduled")
        .otherwise("pending")
    )
    waiting = frames.outbox.select(
        "service", "tenant", "id", "message_type", "last_error", state.alias("state"),
        F.lit("outbox").alias("side"), F.col("created_at").alias("waiting_since"), pending.alias("pending"),
        "started_attempts", "finished_attempts",
    ).unionByName(
        frames.inbox.select(
            "service", "tenant", "id", "message_type", "last_error", state.alias("state"),
            F.lit("inbox").alias("side"), F.col("received_at").alias("waiting_since"), pending.alias("pending"),
            "started_attempts", "finished_attempts",
        )
    )  # fmt: skip
    overdue = F.col("waiting_since").cast("double") < F.lit(as_of).cast("double") - F.lit(judgement.sla_seconds)
    stuck = _finding(
        waiting.where(F.col("pending") & overdue & (F.col("state") != "scheduled")),
        as_of,
        kind=F.lit(STUCK),
        service=F.col("service"),
        tenant=F.col("tenant"),
        message_type=F.col("message_type"),
        message_id=F.col("id"),
        state=F.col("state"),
        reason=F.concat(F.col("side"), F.lit("_pending")),
        since=F.col("waiting_since"),
        count=F.col("started_attempts"),
        detail=F.concat_ws(
            "; ",
            F.concat(F.lit("attempts "), F.col("finished_attempts"), F.lit("/"), F.col("started_attempts")),
            F.col("last_error"),
        ),
    )

    # --- abandoned: open dead letters (not replayed, discarded or resolved).
    dead = frames.dead_letters
    open_ = F.col("replayed_at").isNull() & F.col("discarded_at").isNull() & F.col("resolved_at").isNull()
    abandoned = _finding(
        dead.where(open_),
        as_of,
        kind=F.lit(ABANDONED),
        service=F.col("service"),
        tenant=F.col("tenant"),
        message_type=F.col("message_type"),
        message_id=F.col("message_id"),
        state=F.col("source"),
        reason=F.col("reason"),
        fingerprint=F.col("fingerprint"),
        since=F.col("died_at"),
        detail=F.concat_ws(": ", F.concat(F.lit("dead letter "), F.col("dead_letter_id")), F.col("error")),
    )

    # --- unexpected: in an inbox, in no source's outbox. Only messages stamped inside the
    # window are judged, so the publisher's row (created_at = envelope timestamp) was read.
    all_ids = frames.outbox.select("id")
    strays = (
        frames.inbox.where(F.col("message_timestamp") >= F.lit(judgement.since))
        .join(all_ids, "id", "left_anti")
        .join(F.broadcast(types), "message_type", "left")
    )
    owner_is_source = F.col("owner").isin(services)
    reason = (
        F.when(F.col("contract_kind").isNull(), "unknown_message_type")
        .when((F.col("contract_kind") == "event") & owner_is_source, "not_in_publisher_outbox")
        .when(F.col("contract_kind") == "event", "publisher_not_a_source")
        .otherwise("no_source_outbox_has_it")
    )
    unexpected = _finding(
        strays,
        as_of,
        kind=F.lit(UNEXPECTED),
        service=F.col("service"),
        tenant=F.col("tenant"),
        publisher=F.when(F.col("contract_kind") == "event", F.col("owner")),
        message_type=F.col("message_type"),
        message_id=F.col("id"),
        state=_inbox_state(),
        reason=reason,
        since=F.col("received_at"),
        detail=F.col("queue"),
    )

    # --- another tenant's message: in the inbox of a tenant, in the outbox of another.
    outboxes = frames.outbox.where(F.col("tenant").isNotNull()).select(
        "id", F.col("service").alias("publisher"), F.col("tenant").alias("publisher_tenant")
    )
    crossed = frames.inbox.where(F.col("tenant").isNotNull()).join(outboxes, "id")
    other_tenant = _finding(
        crossed.where(F.col("tenant") != F.col("publisher_tenant")),
        as_of,
        kind=F.lit(UNEXPECTED),
        service=F.col("service"),
        tenant=F.col("tenant"),
        publisher=F.col("publisher"),
        message_type=F.col("message_type"),
        message_id=F.col("id"),
        state=_inbox_state(),
        reason=F.lit("other_tenant"),
        since=F.col("received_at"),
        detail=F.concat(F.lit("published by tenant "), F.col("publisher_tenant"), F.lit(" of "), F.col("publisher")),
    )

    # --- redelivery hot spots: the receiver's PostgreSQL redelivery counter.
    stored = frames.inbox.select(
        F.col("service").alias("s"), F.col("tenant").alias("t"), F.col("id").alias("m"), "message_type"
    )
    counted = frames.redeliveries
    redelivered = _finding(
        counted.join(
            stored,
            (counted["service"] == stored["s"])
            & counted["tenant"].eqNullSafe(stored["t"])
            & (counted["message_id"] == stored["m"]),
            "left",
        ),
        as_of,
        kind=F.lit(REDELIVERED),
        service=F.col("service"),
        tenant=F.col("tenant"),
        message_type=F.col("message_type"),
        message_id=F.col("message_id"),
        state=F.when(F.col("message_type").isNotNull(), "stored").otherwise("not_stored"),
        reason=F.lit("redelivered"),
        since=F.col("first_seen"),
        count=F.col("count"),
        detail=F.col("queue"),
    )

    findings = lost
    for part in (stuck, abandoned, unexpected, other_tenant, redelivered):
        findings = findings.unionByName(part)
    return Reconciliation(findings=findings, notes=notes)
