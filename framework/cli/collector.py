"""`txbox collector`: drain ``<service>:dead_letter`` into ``txbox.dead_letters``."""

from __future__ import annotations

import argparse

from framework import metrics
from framework.cli.common import add_service_options, load_service
from framework.dlq.collector import Collector, CollectorConfig


def configure(parser: argparse.ArgumentParser, name: str) -> None:
    add_service_options(parser)
    parser.add_argument("--batch-size", type=int, help="deliveries per transaction (TXBOX_COLLECTOR_BATCH_SIZE)")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on 127.0.0.1:PORT")


def run(args: argparse.Namespace) -> int:
    service = load_service(args)
    config = CollectorConfig.from_env(batch_size=args.batch_size)
    collector = Collector(service, config)
    collector.install_signal_handlers()
    metrics.serve(args.metrics_port)
    collector.run()
    return 0
