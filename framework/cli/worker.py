"""`txbox worker`: run the inbox worker daemon until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse

from framework.cli.common import add_probe_options, add_service_options, check_assembly, liveness_config, load_service
from framework.liveness import watch
from framework.worker import Worker, WorkerConfig


def configure(parser: argparse.ArgumentParser, name: str) -> None:
    add_service_options(parser)
    add_probe_options(parser)
    parser.add_argument("--batch-size", type=int, help="messages per transaction (TXBOX_WORKER_BATCH_SIZE)")
    parser.add_argument(
        "--segment-policy",
        choices=("proceed", "park"),
        help="after an abandon, later messages of the segment proceed or stay parked (TXBOX_WORKER_SEGMENT_POLICY)",
    )


def run(args: argparse.Namespace) -> int:
    service = load_service(args)
    check_assembly(service, "worker", runs_handlers=True)
    config = WorkerConfig.from_env(batch_size=args.batch_size, segment_policy=args.segment_policy)
    worker = Worker(service, config)
    worker.install_signal_handlers()
    with watch([worker], port=args.metrics_port, config=liveness_config(args)):
        worker.run()
    return 0
