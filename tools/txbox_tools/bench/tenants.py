"""`txbox bench tenants`: one `txbox run` serving N tenants beside one serving one tenant.

Both runs in one session, on a private PostgreSQL of the bench's own (its
``max_connections`` sized for N tenants: each holds about four connections) and the
machine's RabbitMQ, each in a scratch database and vhost. Tenants are schemas of the
scratch database (``t_0`` … ``t_<N-1>``), listed in a registry file. A run measures:

- **idle**: the CPU cores of the `txbox run` process and of the database's backends
  while nothing is sent (``--idle`` seconds, after the daemons are up);
- **connections held**: PostgreSQL backends of the scratch database and RabbitMQ
  connections of its vhost, while idle;
- **throughput**: ``--messages`` Ping commands written into the tenants' outboxes (an
  equal share each, one transaction a tenant), through each tenant's relay, the one
  receiver (routing each to its tenant's inbox by the tenant header) and each tenant's
  worker, until every business row is in: messages a second and CPU per message.

- **fairness** (``--noisy``, the N-tenant run): ``--quiet-messages`` Pings sent one at a
  time at ``--quiet-rate`` into one tenant's outbox, first alone, then right after a
  burst of ``--noisy`` Pings into another tenant's: the quiet tenant's latency (its
  outbox row's creation to its handler's row, p50 and p99) with and without the burst.

The bar is a ratio of the same session: N tenants' throughput against one tenant's with
the same messages (``ratio``), the quiet tenant's p99 with a noisy neighbour against
without (``fairness_p99_ratio``), and the idle cost per tenant (docs/how-to/tenants.md,
"One set of daemons for every tenant"; benchmarks/tenants.md).
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import psycopg

from framework import migrate
from framework.db import conninfo
from framework.errors import TxboxError
from txbox_tools.bench import cpu
from txbox_tools.bench.e2e import Scratch, add_common_options, handled, wait_ready, write_pings
from txbox_tools.bench.result import Result
from txbox_tools.chaos.instances import PrivatePostgres
from txbox_tools.processes import ProcessGroup, raise_if_terminated

CONNECTIONS_PER_TENANT = 4  # benchmarks/tenants.md: a relay's, a worker's two, the handlers' sessions


def configure(parser: argparse.ArgumentParser) -> None:
    add_common_options(parser)
    parser.add_argument("--tenants", type=int, default=100, help="tenants of the second run (default 100)")
    parser.add_argument("--messages", type=int, default=5000, help="messages of each run (default 5000)")
    parser.add_argument("--idle", type=float, default=10.0, help="seconds of idle measurement (default 10)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a run may take to drain (default 600)")
    parser.add_argument("--noisy", type=int, default=20000, help="the noisy tenant's burst (default 20000; 0: none)")
    parser.add_argument("--quiet-messages", type=int, default=100, help="the quiet tenant's messages (default 100)")
    parser.add_argument("--quiet-rate", type=float, default=20.0, help="the quiet tenant's msg/s (default 20)")


def run(args: argparse.Namespace) -> Result:
    if args.tenants < 1 or args.messages < args.tenants:
        raise TxboxError("--tenants must be at least 1 and --messages at least --tenants")
    max_connections = CONNECTIONS_PER_TENANT * args.tenants + 60
    logging.getLogger("alembic").setLevel(logging.WARNING)  # one migration per tenant: a line each
    logging.getLogger("pika").setLevel(logging.CRITICAL)  # wait_ready's passive declares until the queue is there
    with PrivatePostgres(max_connections=max_connections) as pg:
        args.admin_url = pg.admin_url
        one = _measure(args, 1)
        many = _measure(args, args.tenants)
    fairness = many.pop("fairness", None)
    extra = {
        "tenants": args.tenants,
        **(fairness or {}),
        "one_tenant": one,
        "many_tenants": many,
        "idle_cores_per_tenant": round((many["idle_cores"] - one["idle_cores"]) / max(args.tenants - 1, 1), 5),
        "postgres_connections_per_tenant": round(
            (many["postgres_connections"] - one["postgres_connections"]) / max(args.tenants - 1, 1), 2
        ),
    }
    return Result(
        stage="tenants",
        messages=args.messages,
        seconds=many["seconds"],
        raw_limit_rate=args.messages / one["seconds"],
        raw_limit="the same messages through one tenant, in the same session",
        extra=extra,
    )


def _measure(args: argparse.Namespace, tenants: int) -> dict[str, Any]:
    with Scratch(args, f"t{tenants}") as scratch, tempfile.TemporaryDirectory(prefix="txbox-tenants-") as folder:
        schemas = [f"t_{i}" for i in range(tenants)]
        for schema in schemas:
            migrate.upgrade(scratch.database_url, schema)
        registry = Path(folder) / "tenants.toml"
        registry.write_text("".join(f'[tenants.t{i}]\nschema = "{s}"\n' for i, s in enumerate(schemas)))
        log_dir = args.log_dir or Path(folder) / "logs"
        env = {**scratch.env, "TXBOX_TENANTS_FILE": str(registry), "TXBOX_BENCH_HANDLER": "statement"}
        group = ProcessGroup(log_dir, env=env)
        try:
            daemon = group.start("run", ["run", "--app", "txbox_tools.bench.e2e:app", "--without", "collector"])
            wait_ready(scratch, group, timeout=120)
            _settle(scratch, tenants)
            meter = cpu.pipeline([("run", daemon.process.pid)], scratch.database_url)
            meter.start()
            started = time.monotonic()
            time.sleep(args.idle)
            idle = meter.stop()
            idle_wall = time.monotonic() - started
            held = _connections(scratch)
            service = scratch.service()
            cuts = [args.messages * i // tenants for i in range(tenants + 1)]  # an equal share each
            meter = cpu.pipeline([("run", daemon.process.pid)], scratch.database_url)
            meter.start()
            started = time.monotonic()
            for i, schema in enumerate(schemas):
                write_pings(service.with_settings(schema=schema), cuts[i], cuts[i + 1] - cuts[i], echo=False)
            _drain(scratch, group, args.messages, args.timeout)
            seconds = time.monotonic() - started
            busy = meter.stop()
            fairness = _fairness(args, scratch, group, service, schemas) if tenants > 1 and args.noisy else None
        finally:
            group.stop_all()
    return {
        **({"fairness": fairness} if fairness else {}),
        "tenants": tenants,
        "seconds": round(seconds, 3),
        "rate": round(args.messages / seconds, 1),
        "idle_cores": round(sum(idle.values()) / idle_wall, 4),
        "idle_cores_by": {k: round(v / idle_wall, 4) for k, v in idle.items()},
        **held,
        **{f"busy_{k}": v for k, v in cpu.summary(busy, seconds, args.messages).items()},
    }


def _settle(scratch: Scratch, tenants: int, timeout: float = 120.0) -> None:
    """Until every tenant's relay and worker hold their connections (the set is up)."""
    deadline = time.monotonic() + timeout
    while _connections(scratch)["postgres_connections"] < 3 * tenants:
        if time.monotonic() > deadline:
            raise TxboxError(f"the daemons of {tenants} tenants did not connect within {timeout:.0f}s")
        raise_if_terminated()
        time.sleep(0.5)
    time.sleep(2.0)  # the first claims and LISTENs done: idle from here


def _connections(scratch: Scratch) -> dict[str, int]:
    with psycopg.connect(conninfo(scratch.admin_url), autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND application_name <> %s",
            (scratch.dbname, cpu.LOAD_APPLICATION),
        ).fetchone()
    api = scratch.api
    request = urllib.request.Request(f"{api.base}/vhosts/{scratch._q(scratch.vhost)}/connections")
    request.add_header("Authorization", api.auth)
    with urllib.request.urlopen(request, timeout=30) as response:
        amqp = len(json.load(response))
    return {"postgres_connections": int(row[0]) if row else 0, "rabbitmq_connections": amqp}


def _drain(scratch: Scratch, group: ProcessGroup, messages: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with psycopg.connect(conninfo(scratch.database_url), autocommit=True) as conn:
        while handled(conn) < messages:
            dead = group.dead()
            if dead:
                raise TxboxError(f"{dead[0].name} exited: {dead[0].log_tail()}")
            if time.monotonic() > deadline:
                raise TxboxError(f"{handled(conn)} of {messages} handled after {timeout:.0f}s; logs: {group.log_dir}")
            raise_if_terminated()
            time.sleep(0.05)


def _fairness(
    args: argparse.Namespace, scratch: Scratch, group: ProcessGroup, service: Any, schemas: list[str]
) -> dict[str, Any]:
    """The quiet tenant's latency alone, then right after the noisy tenant's burst."""
    noisy, quiet = service.with_settings(schema=schemas[0]), service.with_settings(schema=schemas[1])
    expected = args.messages
    first = args.messages  # Ping numbers go on from the throughput run's
    alone = _quiet(args, scratch, quiet, first)
    expected += args.quiet_messages
    _drain(scratch, group, expected, args.timeout)
    first += args.quiet_messages
    chunk = 2000
    for start in range(0, args.noisy, chunk):  # the burst: committed before the quiet tenant's first
        write_pings(noisy, first + start, min(chunk, args.noisy - start), echo=False)
    first += args.noisy
    burst_started = time.monotonic()
    crowded = _quiet(args, scratch, quiet, first)
    expected += args.noisy + args.quiet_messages
    _drain(scratch, group, expected, args.timeout)
    burst_seconds = time.monotonic() - burst_started
    alone_ms = _latencies(scratch, schemas[1], alone, crowded)
    crowded_ms = _latencies(scratch, schemas[1], crowded, time.time())
    return {
        "fairness_quiet_alone_ms": alone_ms,
        "fairness_quiet_with_noisy_ms": crowded_ms,
        "fairness_p99_ratio": round(crowded_ms["p99"] / max(alone_ms["p99"], 1e-9), 2),
        "fairness_noisy_burst": args.noisy,
        "fairness_noisy_drained_s": round(burst_seconds, 2),
    }


def _quiet(args: argparse.Namespace, scratch: Scratch, quiet: Any, first: int) -> float:
    """Send the quiet tenant's Pings, one transaction each, at ``--quiet-rate``; when they began."""
    began = time.time()
    interval = 1.0 / args.quiet_rate
    due = time.monotonic()
    for n in range(args.quiet_messages):
        write_pings(quiet, first + n, 1, echo=False)
        due += interval
        time.sleep(max(0.0, due - time.monotonic()))
        raise_if_terminated()
    return began


def _latencies(scratch: Scratch, schema: str, since: float, until: float) -> dict[str, Any]:
    """p50, p99 and max of (handler's row minus outbox row's creation) of ``schema``'s Pings
    created from ``since`` to ``until`` (epoch seconds), and the p50 and p99 of each stage's
    end (``published``: the relay marked it; ``stored``: the receiver inserted it into the
    inbox) since the creation, which says where a quiet tenant's messages waited."""
    ms = "extract(epoch FROM {} - o.created_at) * 1000"
    stages = {"published": "o.processed_at", "stored": "i.received_at", "handled": "h.handled_at"}
    columns = ", ".join(f"{ms.format(column)} AS {name}" for name, column in stages.items())
    percentiles = ", ".join(f"percentile_cont(ARRAY[0.5, 0.99]) WITHIN GROUP (ORDER BY {name})" for name in stages)
    with psycopg.connect(conninfo(scratch.database_url), autocommit=True) as conn:
        row = conn.execute(
            f"SELECT {percentiles}, max(handled), count(*) FROM (SELECT {columns} FROM {schema}.outbox o "
            f"JOIN {schema}.inbox i ON i.id = o.id JOIN bench_handled h ON h.message_id = o.id "
            "WHERE o.created_at >= to_timestamp(%s) AND o.created_at < to_timestamp(%s)) t",
            (since, until),
        ).fetchone()
    assert row is not None
    by_stage = dict(zip(stages, row[: len(stages)], strict=True))
    (p50, p99), worst, count = by_stage["handled"], row[len(stages)], row[len(stages) + 1]
    return {
        "p50": round(p50, 1),
        "p99": round(p99, 1),
        "max": round(float(worst), 1),
        "messages": int(count),
        "stages": {name: {"p50": round(a, 1), "p99": round(b, 1)} for name, (a, b) in by_stage.items()},
    }
