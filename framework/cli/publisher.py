"""`txbox publisher`: run the outbox relay daemon."""

from __future__ import annotations

import argparse

from framework.cli.common import (
    add_probe_options,
    add_service_options,
    check_assembly,
    liveness_config,
    load_service,
    quiet_pika,
)
from framework.liveness import watch
from framework.relay import Relay, RelayConfig


def configure(parser: argparse.ArgumentParser, name: str) -> None:
    add_service_options(parser)
    add_probe_options(parser)
    group = parser.add_argument_group("publisher (default: TXBOX_PUBLISHER_* or built-in)")
    group.add_argument("--batch-size", help="rows per claim (TXBOX_PUBLISHER_BATCH_SIZE)")
    group.add_argument("--max-in-flight", help="unconfirmed messages at most (TXBOX_PUBLISHER_MAX_IN_FLIGHT)")
    group.add_argument("--lease", help="claim lease, e.g. 60s (TXBOX_PUBLISHER_LEASE)")
    group.add_argument("--confirm-timeout", help="e.g. 30s (TXBOX_PUBLISHER_CONFIRM_TIMEOUT)")
    group.add_argument("--poll-interval", help="fallback poll, e.g. 1s (TXBOX_PUBLISHER_POLL_INTERVAL)")
    group.add_argument("--drain-timeout", help="wait for confirms on shutdown (TXBOX_PUBLISHER_DRAIN_TIMEOUT)")
    group.add_argument("--max-attempts", help="then dead-letter (TXBOX_PUBLISHER_MAX_ATTEMPTS)")


def config_from(args: argparse.Namespace) -> RelayConfig:
    """Flags over TXBOX_PUBLISHER_* over defaults; a bad value fails naming the variable."""
    return RelayConfig.from_env(
        batch_size=args.batch_size,
        max_in_flight=args.max_in_flight,
        lease=args.lease,
        confirm_timeout=args.confirm_timeout,
        poll_interval=args.poll_interval,
        drain_timeout=args.drain_timeout,
        max_attempts=args.max_attempts,
    )


def run(args: argparse.Namespace) -> int:
    quiet_pika(args)
    service = load_service(args)
    check_assembly(service, "publisher", runs_handlers=False)
    config = config_from(args)
    relay = Relay(service, config)
    relay.install_signal_handlers()
    with watch([relay], port=args.metrics_port, config=liveness_config(args)):
        relay.run()
    return 0
