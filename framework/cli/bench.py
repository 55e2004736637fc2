"""`txbox bench <stage> [--json]`: one module per stage under framework.bench."""

from __future__ import annotations

import argparse
import importlib

from framework.bench.result import Result

STAGES = {
    "relay": "framework.bench.relay",
    "receiver": "framework.bench.receiver",
    "worker": "framework.bench.worker",
    "e2e": "framework.bench.e2e",
    "latency": "framework.bench.latency",
    "analyze": "framework.bench.analyze",
    "outbox-write": "framework.bench.outbox_write",
    "dashboard": "framework.bench.dashboard",
}


def configure(parser: argparse.ArgumentParser, name: str) -> None:
    sub = parser.add_subparsers(dest="stage", required=True, metavar="stage")
    for stage, module_name in STAGES.items():
        p = sub.add_parser(stage)
        p.add_argument("--json", action="store_true", help="print the result as one JSON line (last line)")
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue  # a stage whose optional dependencies are missing
        module.configure(p)


def run(args: argparse.Namespace) -> int:
    module = importlib.import_module(STAGES[args.stage])
    result: Result = module.run(args)
    print(result.report(args.json), flush=True)
    return 0
