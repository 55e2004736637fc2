"""`txbox chaos`: the example saga under load with seeded crashes, restarts and a poison message.

Exit status: 0 when every check of the verdict holds (and `txbox analyze --fail-on-lost`
found nothing lost), 1 on any violation, 2 when the run could not be carried out.
The logic is in :mod:`txbox_tools.chaos.run`; it needs a checkout of the repository (the
example services live in ``examples/``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from framework.errors import ConfigurationError
from txbox_tools.processes import unwind_on_sigterm

HELP = "fault-injection run: kills and restarts under load"


def configure(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("--messages", type=int, default=50_000, help="orders to place (3 handled messages each)")
    parser.add_argument("--faults", type=int, default=16, help="faults to inject, besides the poison message")
    parser.add_argument("--seed", type=int, default=1, help="seed of every random choice (replay a run with it)")
    parser.add_argument("--rate", type=float, default=600.0, help="orders/s offered (default 600)")
    parser.add_argument("--skus", type=int, default=20, help="distinct products")
    parser.add_argument("--workers", type=int, default=1, help="worker processes per service (default 1)")
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="processes of every daemon per service (default 1); kills pick among them",
    )
    parser.add_argument(
        "--deployment",
        choices=("daemons", "run"),
        default="daemons",
        help="daemons: a process per daemon (default); run: one `txbox run` per service and replica",
    )
    parser.add_argument(
        "--tenants",
        type=int,
        default=0,
        help="tenants of every service, a database each, served by one `txbox run` per service "
        "(needs --deployment run; default 0: none)",
    )
    parser.add_argument("--no-poison", action="store_true", help="do not send the poison message")
    parser.add_argument("--no-analyze", action="store_true", help="skip `txbox analyze --fail-on-lost`")
    parser.add_argument(
        "--rabbit-nodes",
        type=int,
        default=1,
        help="private RabbitMQ nodes: 1 (default) or a cluster of 3 or more, which adds the rabbitmq_node_kill fault",
    )
    parser.add_argument(
        "--lose-node",
        action="store_true",
        help="on a cluster, end the schedule with rabbitmq_node_lost: the inbox leader's node killed for good",
    )
    parser.add_argument("--queue-type", choices=("quorum", "classic"), default="quorum", help="inbox queue type")
    parser.add_argument("--drain-timeout", type=float, default=600.0, help="seconds allowed for the final drain")
    parser.add_argument("--stall-timeout", type=float, default=180.0, help="fail after this many s without progress")
    parser.add_argument("--log-dir", type=Path, help="daemon logs here (default: a temp dir, removed when OK)")
    parser.add_argument("--keep-logs", action="store_true", help="keep the daemon logs even when the run is OK")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object (last line)")


def run(args: argparse.Namespace) -> int:
    if args.messages < 1 or args.faults < 0 or args.rate <= 0:
        raise ConfigurationError("--messages must be ≥ 1, --faults ≥ 0 and --rate > 0")
    if args.rabbit_nodes < 1 or args.rabbit_nodes == 2:
        raise ConfigurationError(
            f"--rabbit-nodes {args.rabbit_nodes}: give 1, or 3 or more (a cluster of two cannot lose a node)"
        )
    if args.tenants < 0 or (args.tenants and args.deployment != "run"):
        raise ConfigurationError(
            f"--tenants {args.tenants}: give 0, or N ≥ 1 with --deployment run (`txbox run` serves tenants)"
        )
    if args.lose_node and args.rabbit_nodes < 3:
        raise ConfigurationError("--lose-node needs a RabbitMQ cluster: add --rabbit-nodes 3")
    from txbox_tools.chaos import run as chaos  # finds the clone's examples/ (txbox_tools.repository)

    options = chaos.ChaosOptions(
        messages=args.messages,
        faults=args.faults,
        seed=args.seed,
        rate=args.rate,
        skus=args.skus,
        poison=not args.no_poison,
        analyze=not args.no_analyze,
        queue_type=args.queue_type,
        workers=max(1, args.workers),
        replicas=max(1, args.replicas),
        rabbit_nodes=args.rabbit_nodes,
        lose_node=args.lose_node,
        deployment=args.deployment,
        tenants=args.tenants,
        drain_timeout=args.drain_timeout,
        stall_timeout=args.stall_timeout,
        log_dir=args.log_dir,
        keep_logs=args.keep_logs,
    )
    import logging

    logging.getLogger("alembic").setLevel(logging.WARNING)  # one line per migration step, twice
    # The private PostgreSQL and RabbitMQ stop with the run too.
    unwind_on_sigterm()
    report = chaos.run(options)
    print(report.line(), flush=True)
    if args.json:
        print(chaos.report_json(report), flush=True)
    return 0 if report.ok else 1
