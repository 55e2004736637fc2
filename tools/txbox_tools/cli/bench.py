"""`txbox bench <stage> [--json]`: one module per stage under txbox_tools.bench."""

from __future__ import annotations

import argparse
import importlib

from txbox_tools.bench.result import Result
from txbox_tools.processes import unwind_on_sigterm

HELP = "benchmarks: relay, receiver, worker, e2e, latency, analyze, outbox-write, dashboard, soak, tenants"

# stage → (module, one line for `txbox bench --help`)
STAGES: dict[str, tuple[str, str]] = {
    "relay": ("txbox_tools.bench.relay", "outbox rows → confirmed in RabbitMQ by the relay"),
    "receiver": ("txbox_tools.bench.receiver", "deliveries → inbox rows committed and acked"),
    "worker": ("txbox_tools.bench.worker", "inbox rows → a handler's business row → processed"),
    "e2e": ("txbox_tools.bench.e2e", "messages/s through every daemon, each a process"),
    "latency": ("txbox_tools.bench.latency", "outbox commit → handler commit (p50, p99)"),
    "analyze": ("txbox_tools.bench.analyze", "the Spark job over 1M + 1M rows (spark extra)"),
    "outbox-write": ("txbox_tools.bench.outbox_write", "what one outbox row adds to a transaction"),
    "dashboard": ("txbox_tools.bench.dashboard", "dashboard page times over 100,000 dead letters"),
    "soak": ("txbox_tools.bench.soak", "steady load for --duration with retention on: flat p99 and table sizes"),
    "tenants": ("txbox_tools.bench.tenants", "one `txbox run` serving N tenants beside one serving one tenant"),
}


class _OneLinePerStage(argparse.HelpFormatter):
    """`txbox bench --help`: each stage and its help on one line.

    argparse sizes the help column without the extra indent of sub-command names, so a
    12-wide name (outbox-write) would get a line of its own; the column is reserved here.
    """

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=20, width=100)
        self._action_max_length = 18


def configure(parser: argparse.ArgumentParser, name: str) -> None:
    parser.formatter_class = _OneLinePerStage
    sub = parser.add_subparsers(dest="stage", required=True, metavar="stage", title="stages")
    for stage, (module_name, help_) in STAGES.items():
        p = sub.add_parser(stage, help=help_, description=help_)
        p.add_argument("--json", action="store_true", help="print the result as one JSON line (last line)")
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue  # a stage whose optional dependencies are missing
        module.configure(p)


def run(args: argparse.Namespace) -> int:
    module = importlib.import_module(STAGES[args.stage][0])
    unwind_on_sigterm()  # a killed bench stops its daemons and drops its scratch service
    result: Result = module.run(args)
    print(result.report(args.json), flush=True)
    return 0
