"""`txbox analyze` as a function, and as a script for spark-submit.

spark-submit (the script owns no master: spark-submit's ``--master`` applies)::

    spark-submit --master 'local[*]' --driver-memory 2g \\
        --jars /usr/share/java/postgresql.jar \\
        "$(python -c 'import framework.analytics.job as j; print(j.__file__)')" \\
        --source order-service=postgresql://postgres@127.0.0.1:5432/orders \\
        --source inventory-service=postgresql://postgres@127.0.0.1:5432/inventory

On a standalone cluster the same line takes ``--master spark://HOST:7077 --deploy-mode
client`` (Spark runs Python drivers on a standalone cluster in client mode only); on
Kubernetes, ``--deploy-mode cluster`` and an image with ``txbox[spark]``
(docs/how-to/spark-cluster.md). The arguments after the script are those of `txbox analyze`;
``archive`` followed by the arguments of `txbox archive` runs the archive instead.
Run it with the venv active (spark-submit locates its Spark home through the ``python``
on PATH, or set SPARK_HOME / PYSPARK_PYTHON). Under spark-submit the session takes
master, memory and jars from spark-submit; ``--master`` after the script still
overrides the master.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from framework.analytics import reconcile as rc
from framework.analytics.locations import Storage, location
from framework.analytics.read import load
from framework.analytics.report import Writer
from framework.analytics.settings import AnalyzeSettings
from framework.analytics.sources import Source
from framework.analytics.stats import analyze
from framework.contracts import Registry

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

log = logging.getLogger("txbox.analyze")
SAMPLE_IDS = 10


@dataclass
class RunResult:
    run_id: str
    run_at: datetime
    counts: dict[str, int]
    samples: dict[str, list[dict[str, Any]]]
    notes: list[str]
    outbox_rows: int
    inbox_rows: int
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def lost(self) -> int:
        return self.counts.get(rc.LOST, 0)

    def summary(self) -> str:
        lines = [
            f"txbox analyze run {self.run_id} at {self.run_at:%Y-%m-%d %H:%M:%S}Z: "
            f"{self.outbox_rows} outbox + {self.inbox_rows} inbox rows in {self.seconds:.1f} s"
        ]
        for kind in rc.KINDS:
            lines.append(f"  {kind:<12} {self.counts.get(kind, 0)}")
            for s in self.samples.get(kind, []):
                service = f"{s['service']}/{s['tenant']}" if s.get("tenant") else s["service"]
                where = f"{s['publisher']} → {service}" if s.get("publisher") else service
                extra = " ".join(str(s[k]) for k in ("state", "reason") if s.get(k))
                lines.append(f"      {s['message_id'] or '-'}  {s['message_type'] or '?'}  {where}  {extra}")
            more = self.counts.get(kind, 0) - len(self.samples.get(kind, []))
            if more > 0:
                lines.append(f"      ... and {more} more (table analytics_findings, run_id {self.run_id})")
        lines += [f"  note: {n}" for n in self.notes]
        if self.counts.get(rc.ABANDONED):
            # `dlq show` takes a letter's id; the findings name messages. A tenant's letters are its own.
            tenants = any(s.get("tenant") for samples in self.samples.values() for s in samples)
            where = " --tenant <tenant>" if tenants else ""
            lines.append(f"  act on a message: txbox dlq list --message-id <message id>{where}")
        return "\n".join(lines)


def run_once(
    spark: SparkSession,
    *,
    sources: list[Source],
    registry: Registry,
    settings: AnalyzeSettings,
    schema: str = "txbox",
    report_url: str | None = None,
    parquet: str | os.PathLike[str] | None = None,
    history: str | os.PathLike[str] | None = None,
    now: Callable[[], datetime] = lambda: datetime.now(UTC),
) -> RunResult:
    """One reconciliation + analytics pass; writes the report and returns the summary.

    ``parquet`` and ``history`` are URIs or plain paths (see ``locations``); on a cluster
    they must name storage that the driver and every executor share.
    """
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    # Resolved before the first read: a location this Spark cannot reach fails now.
    out = None if parquet is None else Storage(spark, location(os.fspath(parquet), "--parquet"), "--parquet")
    archive = None if history is None else Storage(spark, location(os.fspath(history), "--history"), "--history")

    started = now()
    run_at = started
    since = started - timedelta(seconds=settings.window)
    run_id = f"{started:%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:8]}"
    services = list(dict.fromkeys(s.service for s in sources))
    tenanted = {s.service for s in sources if s.tenant is not None}
    frames = load(spark, sources, settings, schema, since, archive)
    phases: dict[str, float] = {}
    mark = time.perf_counter()

    def phase(name: str) -> None:
        nonlocal mark
        phases[name] = round(time.perf_counter() - mark, 2)
        mark = time.perf_counter()
        log.info("analyze %s: %s done in %.1f s", run_id, name, phases[name])

    outbox_rows = frames.outbox.count()
    inbox_rows = frames.inbox.count()
    phase("read")
    judgement = rc.Judgement(as_of=started, since=since, grace_seconds=settings.grace, sla_seconds=settings.sla)
    rec = rc.reconcile(spark, frames, registry, services, judgement, tenanted)
    findings = rec.findings.persist()
    # Counts and the first ids of every kind in one pass: each Spark action is a job of its
    # own, scheduled and run across the executors (benchmarks/code-choices.md, "Spark: the
    # JVM's start and an action").
    by_kind = Window.partitionBy("kind")
    head = (
        findings.withColumn("_n", F.count(F.lit(1)).over(by_kind))
        .withColumn("_rank", F.row_number().over(by_kind.orderBy("since", "message_id")))
        .where(F.col("_rank") <= SAMPLE_IDS)
        .collect()
    )
    counts = {r["kind"]: int(r["_n"]) for r in head}
    phase("reconcile")
    samples: dict[str, list[dict[str, Any]]] = {}
    for r in sorted(head, key=lambda r: r["_rank"]):
        samples.setdefault(r["kind"], []).append({k: v for k, v in r.asDict().items() if not k.startswith("_")})
    notes = [f"judged: {judged(sources)} (only services whose database is a source can be judged)"]
    missing = sorted(set(registry.services) - set(services))
    if missing:
        notes.append(f"contract services that are not sources: {', '.join(missing)}")
    notes += rec.notes

    an = analyze(frames, since, settings.ids_per_group)
    writer = Writer(spark, report_url, schema, out)
    from framework.analytics.report import conform

    outputs: list[tuple[str, DataFrame]] = [
        ("analytics_findings", findings),
        ("analytics_latency", an.latency),
        ("analytics_throughput", an.throughput),
        ("analytics_attempts", an.attempts),
        ("analytics_message_types", an.message_types),
        ("analytics_fingerprints", an.fingerprints),
        ("analytics_dead_letter_trend", an.dead_letter_trend),
    ]
    for table, df in outputs:
        writer.table(table, conform(df, table, run_id, run_at), run_id)
        phase(table)
    finished = now()
    writer.run_row(
        {
            "run_id": run_id,
            "run_at": run_at,
            "finished_at": finished,
            "sources": ",".join(s.name for s in sources),
            "window_start": since,
            "grace_seconds": float(settings.grace),
            "sla_seconds": float(settings.sla),
            "outbox_rows": outbox_rows,
            "inbox_rows": inbox_rows,
            "lost": counts.get(rc.LOST, 0),
            "in_flight": counts.get(rc.IN_FLIGHT, 0),
            "stuck": counts.get(rc.STUCK, 0),
            "abandoned": counts.get(rc.ABANDONED, 0),
            "unexpected": counts.get(rc.UNEXPECTED, 0),
            "redelivered": counts.get(rc.REDELIVERED, 0),
            "notes": "\n".join(notes),
        }
    )
    for df in (findings, frames.outbox, frames.inbox, frames.dead_letters, frames.redeliveries):
        df.unpersist()
    return RunResult(
        run_id=run_id,
        run_at=run_at,
        counts=counts,
        samples=samples,
        notes=notes,
        outbox_rows=outbox_rows,
        inbox_rows=inbox_rows,
        seconds=(finished - started).total_seconds(),
        extra={"phases": phases},
    )


def judged(sources: list[Source]) -> str:
    """The services read, each with its tenants: ``order-service (tenants acme, globex), inventory-service``."""
    tenants: dict[str, list[str]] = {}
    for s in sources:
        tenants.setdefault(s.service, []).extend([s.tenant] if s.tenant is not None else [])
    shown = []
    for service, keys in tenants.items():
        listed = ", ".join(keys[:10]) + (f" and {len(keys) - 10} more" if len(keys) > 10 else "")
        shown.append(f"{service} (tenants {listed})" if keys else service)
    return ", ".join(shown)


def main() -> int:
    """Entry point under spark-submit: the arguments of `txbox analyze`, or ``archive`` and those of `txbox archive`."""
    import sys

    from framework.cli import main as cli_main

    args = sys.argv[1:]
    if args[:1] == ["archive"]:
        return cli_main(args)
    return cli_main(["analyze", *args])


if __name__ == "__main__":
    raise SystemExit(main())
