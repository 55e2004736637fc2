"""`txbox demo`: the example order/inventory saga end to end, with a summary.

The logic lives in ``examples/demo.py`` beside the example services it drives; this
module only maps flags onto :class:`examples.demo.DemoOptions`. It needs a checkout of
the repository (the examples are not part of the installed package).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path
from typing import Any

from framework.errors import ConfigurationError
from txbox_tools import repository

HELP = "the example saga, end to end, with a summary"


def _options() -> Any:
    # Alembic narrates its plugins and every migration step at INFO: noise in a demo.
    logging.getLogger("alembic").setLevel(logging.WARNING)
    repository.import_examples()
    try:
        from examples import demo
    except ImportError as exc:
        raise ConfigurationError(
            f"txbox demo needs the repository's examples/ folder ({exc}); run it from a clone: make demo"
        ) from None
    return demo


def configure(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("--orders", type=int, default=20_000, help="orders to place (default 20,000)")
    parser.add_argument("--window", type=int, default=500, help="most orders in flight at once (default 500)")
    parser.add_argument("--workers", type=int, default=1, help="worker processes per service (default 1)")
    parser.add_argument("--rate", type=float, default=0.0, help="offered orders/s (default: as fast as --window)")
    parser.add_argument("--skus", type=int, default=20, help="distinct products (default 20)")
    parser.add_argument(
        "--stock-ratio", type=float, default=0.9, help="stock as a share of demand; < 1 cancels some (default 0.9)"
    )
    parser.add_argument(
        "--single-process", action="store_true", help="one `txbox run` per service instead of one process per daemon"
    )
    parser.add_argument(
        "--pg-url",
        default=os.environ.get("TXBOX_DEMO_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres"),
        help="PostgreSQL admin URL used to create the demo databases (env TXBOX_DEMO_PG_URL)",
    )
    parser.add_argument(
        "--amqp-url",
        default=os.environ.get("TXBOX_DEMO_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"),
        help="RabbitMQ URL without vhost (env TXBOX_DEMO_AMQP_URL)",
    )
    parser.add_argument(
        "--rabbitmq-api",
        default=os.environ.get("TXBOX_DEMO_RABBITMQ_API", "http://127.0.0.1:15672/api"),
        help="RabbitMQ management API, to create the vhost (env TXBOX_DEMO_RABBITMQ_API)",
    )
    parser.add_argument("--vhost", default="txbox-demo", help="RabbitMQ vhost, recreated (default txbox-demo)")
    parser.add_argument(
        "--db-prefix",
        default="txbox_demo",
        help="databases <prefix>_orders and <prefix>_inventory, recreated (default txbox_demo)",
    )
    parser.add_argument("--log-dir", type=Path, help="daemon logs (default: .demo/logs in the repository)")
    parser.add_argument("--stall-timeout", type=float, default=90.0, help="give up after this many s without progress")
    parser.add_argument("--no-analyze", action="store_true", help="skip `txbox analyze` after the run")
    parser.add_argument("--no-dashboard", action="store_true", help="do not print the dashboard command")
    parser.add_argument("--json", action="store_true", help="also print the summary as one JSON line (last line)")


def run(args: argparse.Namespace) -> int:
    demo = _options()
    options = demo.DemoOptions(
        orders=args.orders,
        window=args.window,
        workers=args.workers,
        rate=args.rate,
        skus=args.skus,
        stock_ratio=args.stock_ratio,
        single_process=args.single_process,
        pg_url=args.pg_url,
        amqp_url=args.amqp_url,
        rabbitmq_api=args.rabbitmq_api,
        vhost=args.vhost,
        orders_db=f"{args.db_prefix}_orders",
        inventory_db=f"{args.db_prefix}_inventory",
        stall_timeout=args.stall_timeout,
        **({"log_dir": args.log_dir} if args.log_dir else {}),
        analyze=not args.no_analyze,
        dashboard=not args.no_dashboard,
    )
    if options.orders < 1 or options.window < 1:
        raise ConfigurationError("--orders and --window must be at least 1")
    summary = demo.run(options)
    if args.json:
        print(json.dumps(summary.as_dict()))
    return 0 if summary.ok else 1
