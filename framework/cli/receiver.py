"""`txbox receiver`: run the inbox receiver daemon until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse

from framework.cli.common import add_probe_options, add_service_options, check_assembly, liveness_config, load_service
from framework.liveness import watch
from framework.receiver import Receiver, ReceiverConfig


def configure(parser: argparse.ArgumentParser, name: str) -> None:
    add_service_options(parser)
    add_probe_options(parser)
    parser.add_argument("--prefetch", type=int, help="unacked deliveries in flight (TXBOX_RECEIVER_PREFETCH)")
    parser.add_argument("--batch-size", type=int, help="deliveries per transaction (TXBOX_RECEIVER_BATCH_SIZE)")
    parser.add_argument(
        "--retry-schedule", help="broker-level retry delays, e.g. 10s*4,30s*4 (TXBOX_RECEIVER_RETRY_SCHEDULE)"
    )


def run(args: argparse.Namespace) -> int:
    service = load_service(args)
    check_assembly(service, "receiver", runs_handlers=False)  # also: the contracts lack this service
    config = ReceiverConfig.from_env(
        prefetch=args.prefetch, batch_size=args.batch_size, retry_schedule=args.retry_schedule
    )
    receiver = Receiver(service, config)
    receiver.install_signal_handlers()
    with watch([receiver], port=args.metrics_port, config=liveness_config(args)):
        receiver.run()
    return 0
