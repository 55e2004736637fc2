"""`txbox bench soak`: hours of steady load with retention on; do costs stay flat?

The scratch service of ``txbox bench e2e`` (database, vhost, daemon processes of its
own) receives ``--rate`` Ping commands per second for ``--duration``, each written by a
business transaction of its own that also records its send time in ``bench_sent`` (a
business row: the outbox rows themselves are pruned during the run). The daemons run
with every retention set to ``--retention`` and a pruning pass every
``--prune-interval``, so the publisher and the worker delete while they work
(docs/explanation/operations.md, "Retention").

Every ``--sample`` seconds a sampler records the handled rate, p50/p99 of send →
handler commit over the messages handled since the last sample, and for the outbox and
the inbox their live rows, table and index bytes and dead tuples. ``--out DIR`` gets
``soak.json`` (the samples and the verdict) and ``soak.svg`` (rate, p99 and table sizes
over time, drawn without a plotting library). The verdict: p99 of the last five
minutes at most 1.5 times that of the first five (windows shrink to a fifth of the run
when it is shorter), and each table's size (with its indexes) at the end at most twice
its smallest in the first fifth of the samples taken after two retention periods
(bounded, not growing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg

from framework import names, topology
from framework.db import conninfo
from framework.errors import TxboxError
from framework.settings import parse_duration
from txbox_tools.bench.e2e import Scratch, add_common_options, wait_ready
from txbox_tools.bench.latency import Sender, add_writers_option, paced, writers
from txbox_tools.bench.result import Result
from txbox_tools.processes import ProcessGroup

WINDOW = 300.0  # seconds compared at the start and at the end of a long run
P99_BAR = 1.5


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", default="30m", help="how long the load runs (default 30m)")
    parser.add_argument("--rate", type=float, default=1000.0, help="offered messages/s (default 1000)")
    add_writers_option(parser)
    parser.add_argument("--retention", default="2m", help="every TXBOX_*_RETENTION and the dedup window (2m)")
    parser.add_argument("--prune-interval", default="10s", help="TXBOX_RETENTION_INTERVAL of the daemons (10s)")
    parser.add_argument("--sample", default="10s", help="seconds between two samples (default 10s)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/soak"), help="folder for soak.json, soak.svg")
    add_common_options(parser)


def run(args: argparse.Namespace) -> Result:
    args.writers = writers(args)
    duration, every = parse_duration(args.duration), parse_duration(args.sample)
    retention = parse_duration(args.retention)
    with Scratch(args, "soak") as scratch:
        service = scratch.service()
        topology.declare(service.settings, service.registry)
        with psycopg.connect(conninfo(scratch.database_url), autocommit=True) as conn:
            conn.execute("CREATE TABLE bench_sent (message_id uuid PRIMARY KEY, sent_at timestamptz NOT NULL)")
            conn.execute("CREATE INDEX bench_handled_at_idx ON bench_handled (handled_at)")
        env = {
            **scratch.env,
            "TXBOX_OUTBOX_RETENTION": args.retention,
            "TXBOX_INBOX_RETENTION": args.retention,
            "TXBOX_DEDUP_WINDOW": args.retention,
            "TXBOX_ABANDONED_RETENTION": args.retention,
            "TXBOX_RETENTION_INTERVAL": args.prune_interval,
        }
        log_dir = args.log_dir or Path(scratch.tmp.name) / "logs"
        group = ProcessGroup(log_dir, env=env)
        sampler = _Sampler(scratch.database_url, every)
        try:
            scratch.start_daemons(group, args.workers)
            wait_ready(scratch, group)
            sampler.start()
            sent, seconds = _offer(scratch, args, duration)
            if group.dead():
                raise TxboxError(f"{group.dead()[0].name} exited: {group.dead()[0].log_tail()}")
        finally:
            sampler.stop()
            group.stop_all()
            service.engine.dispose()
    if sampler.error is not None:
        raise TxboxError(f"the soak's sampler failed: {sampler.error!r}")
    verdict = judge(sampler.samples, retention)
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {"offered_rate": args.rate, "duration_s": duration, "retention_s": retention, **verdict}
    (args.out / "soak.json").write_text(json.dumps({**summary, "samples": sampler.samples}, indent=1))
    (args.out / "soak.svg").write_text(svg(sampler.samples))
    return Result(
        stage="soak",
        messages=sent,
        seconds=seconds,
        raw_limit_rate=args.rate,
        raw_limit="the offered rate (a soak has no raw measurement; ratio = the writers' rate / offered)",
        extra={**summary, "out": str(args.out), "samples": len(sampler.samples), "workers": args.workers},
    )


def _offer(scratch: Scratch, args: argparse.Namespace, duration: float) -> tuple[int, float]:
    """Open-loop Pings: each its own business transaction, with its send time in bench_sent."""
    from framework.outbox import Outbox
    from framework.sql import outbox as outbox_sql

    service = scratch.service()
    spec = service.registry.get("Ping")
    builder = Outbox(None, service.registry)  # type: ignore[arg-type]  # build() never writes
    statement = outbox_sql.insert(service.settings.schema)

    @contextmanager
    def sender() -> Iterator[Sender]:
        with psycopg.connect(conninfo(service.settings.database_url)) as conn:

            def send(i: int) -> None:
                row = builder.build(spec, aggregate_id=f"p{i}", payload={"n": i, "echo": False})
                conn.execute(statement, row.params())
                conn.execute("INSERT INTO bench_sent VALUES (%s, clock_timestamp())", (row.id,))
                conn.commit()

            yield send

    total = int(args.rate * duration)
    seconds = paced(total, args.rate, args.writers, sender)
    service.engine.dispose()
    return total, seconds


_SAMPLE = """
WITH l AS (
    SELECT extract(epoch FROM h.handled_at - s.sent_at) * 1000 AS ms
    FROM bench_handled h JOIN bench_sent s USING (message_id)
    WHERE h.handled_at > %(since)s AND h.handled_at <= %(until)s
)
SELECT count(*), percentile_cont(ARRAY[0.5, 0.99]) WITHIN GROUP (ORDER BY ms) FROM l
"""

_TABLES = """
SELECT c.relname, coalesce(s.n_live_tup, 0), pg_table_size(c.oid), pg_indexes_size(c.oid), coalesce(s.n_dead_tup, 0)
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
WHERE n.nspname = 'txbox' AND c.relname = ANY(%(tables)s)
"""


class _Sampler:
    """A thread taking one sample every ``every`` seconds until :meth:`stop`."""

    def __init__(self, database_url: str, every: float) -> None:
        self._url = database_url
        self._every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak sampler", daemon=True)
        self.samples: list[dict[str, Any]] = []
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)

    def _run(self) -> None:
        try:
            with psycopg.connect(conninfo(self._url), autocommit=True) as conn:
                started = since = conn.execute("SELECT clock_timestamp()").fetchone()[0]  # type: ignore[index]
                while not self._stop.wait(self._every):
                    until = conn.execute("SELECT clock_timestamp()").fetchone()[0]  # type: ignore[index]
                    self.samples.append(self._sample(conn, (until - started).total_seconds(), since, until))
                    since = until
        except BaseException as exc:  # the soak's result says so; the load goes on
            self.error = exc

    def _sample(self, conn: psycopg.Connection[Any], t: float, since: Any, until: Any) -> dict[str, Any]:
        count, pcts = conn.execute(_SAMPLE, {"since": since, "until": until}).fetchone() or (0, None)
        seconds = (until - since).total_seconds()
        sample: dict[str, Any] = {
            "t": round(t, 1),
            "rate": round(count / seconds, 1) if seconds > 0 else 0.0,
            "p50_ms": round(float(pcts[0]), 2) if pcts else None,
            "p99_ms": round(float(pcts[1]), 2) if pcts else None,
        }
        for name, live, table, index, dead in conn.execute(_TABLES, {"tables": [names.OUTBOX, names.INBOX]}):
            sample[name] = {"rows": live, "table_bytes": table, "index_bytes": index, "dead_tuples": dead}
        return sample


def judge(samples: list[dict[str, Any]], retention: float) -> dict[str, Any]:
    """The soak's verdict (the module docstring) from its samples (the run may have lasted
    longer than ``--duration`` when the writers fell behind their schedule)."""
    duration = max((float(s["t"]) for s in samples), default=0.0)
    window = min(WINDOW, duration / 5)
    first = [s["p99_ms"] for s in samples if s["t"] <= window and s["p99_ms"] is not None]
    last = [s["p99_ms"] for s in samples if s["t"] >= duration - window and s["p99_ms"] is not None]
    rates = [s["rate"] for s in samples]
    verdict: dict[str, Any] = {
        "handled_rate_median": statistics.median(rates) if rates else 0.0,
        "handled_rate_range": [min(rates), max(rates)] if rates else None,
        "window_s": window,
        "p99_first_ms": round(statistics.median(first), 2) if first else None,
        "p99_last_ms": round(statistics.median(last), 2) if last else None,
    }
    if first and last:
        verdict["p99_ratio"] = round(verdict["p99_last_ms"] / verdict["p99_first_ms"], 3)
        verdict["p99_within_bar"] = verdict["p99_ratio"] <= P99_BAR
    settled = [s for s in samples if s["t"] >= retention * 2]
    for table in (names.OUTBOX, names.INBOX):
        sizes = [s[table]["table_bytes"] + s[table]["index_bytes"] for s in settled if table in s]
        if sizes:
            verdict[f"{table}_bytes_max"] = max(sizes)
            verdict[f"{table}_bytes_end"] = sizes[-1]
            verdict[f"{table}_dead_tuples_max"] = max(s[table]["dead_tuples"] for s in settled if table in s)
            verdict[f"{table}_bounded"] = sizes[-1] <= 2 * min(sizes[: max(1, len(sizes) // 5)])
    return verdict


def svg(samples: list[dict[str, Any]], width: int = 900, height: int = 200) -> str:
    """Three stacked line charts (rate, p99, outbox + inbox bytes) against time, as plain SVG."""
    series: list[tuple[str, list[tuple[str, str, list[float]]]]] = [
        ("handled messages/s", [("rate", "#1f77b4", [float(s["rate"]) for s in samples])]),
        ("p50 / p99 ms", [
            ("p50", "#2ca02c", [float(s["p50_ms"] or 0) for s in samples]),
            ("p99", "#d62728", [float(s["p99_ms"] or 0) for s in samples]),
        ]),
        ("table + index MB", [
            (t, c, [(s.get(t, {}).get("table_bytes", 0) + s.get(t, {}).get("index_bytes", 0)) / 1e6 for s in samples])
            for t, c in ((names.OUTBOX, "#9467bd"), (names.INBOX, "#ff7f0e"))
        ]),
    ]  # fmt: skip
    times = [float(s["t"]) for s in samples] or [0.0]
    t_max = max(times) or 1.0
    margin, gap = 60, 40
    total_height = len(series) * (height + gap) + gap
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{total_height}" font-family="sans-serif" '
        'font-size="12">',
        f'<rect width="{width}" height="{total_height}" fill="white"/>',
    ]
    for n, (title, lines) in enumerate(series):
        top = gap + n * (height + gap)
        y_max = max((v for _, _, values in lines for v in values), default=1.0) or 1.0
        out.append(f'<text x="{margin}" y="{top - 8}">{title} (max {y_max:.4g}) over {t_max:.0f} s</text>')
        out.append(
            f'<rect x="{margin}" y="{top}" width="{width - 2 * margin}" height="{height}" fill="none" stroke="#999"/>'
        )
        for label, colour, values in lines:
            points = " ".join(
                f"{margin + (width - 2 * margin) * t / t_max:.1f},{top + height - height * v / y_max:.1f}"
                for t, v in zip(times, values, strict=False)
            )
            out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{points}"/>')
            out.append(f'<text x="{width - margin + 4}" y="{top + 14 * (1 + lines.index((label, colour, values)))}" '
                       f'fill="{colour}">{label}</text>')  # fmt: skip
    out.append("</svg>")
    return "\n".join(out)
