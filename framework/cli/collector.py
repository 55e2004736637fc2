"""`txbox collector`: drain ``<service>:dead_letter`` into ``txbox.dead_letters``."""

from __future__ import annotations

import argparse

from framework.cli.common import add_probe_options, add_service_options, check_assembly, liveness_config, load_service
from framework.dead_letters.collector import Collector, CollectorConfig
from framework.liveness import watch


def configure(parser: argparse.ArgumentParser, name: str) -> None:
    add_service_options(parser)
    parser.add_argument("--batch-size", type=int, help="deliveries per transaction (TXBOX_COLLECTOR_BATCH_SIZE)")
    add_probe_options(parser)


def run(args: argparse.Namespace) -> int:
    service = load_service(args)
    check_assembly(service, "collector", runs_handlers=False)
    config = CollectorConfig.from_env(batch_size=args.batch_size)
    collector = Collector(service, config)
    collector.install_signal_handlers()
    with watch([collector], port=args.metrics_port, config=liveness_config(args)):
        collector.run()
    return 0
