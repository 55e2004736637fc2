"""`txbox topology`: declare exchanges, queues and bindings (shared with Mosaic services: see `framework.topology`)."""

from __future__ import annotations

import argparse
import sys

from framework import delivery_limit, topology
from framework.cli.common import add_service_options, load_service, quiet_pika


def configure(parser: argparse.ArgumentParser, name: str) -> None:
    add_service_options(parser)


def run(args: argparse.Namespace) -> int:
    quiet_pika(args)
    service = load_service(args, database=False)  # only the broker and the contracts
    declared = topology.declare(service.settings, service.registry)
    print(f"exchanges: {', '.join(declared.exchanges)}")
    for queue in declared.queues:
        binds = ", ".join(f"{e}:{k}" for e, k in queue.bindings)
        print(f"queue {queue.name} {queue.arguments} ← {binds}")
    limit = delivery_limit.ensure(service.settings)
    print(limit.message if limit.held else f"warning: {limit.message}", file=sys.stdout if limit.held else sys.stderr)
    return 0
