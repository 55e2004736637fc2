"""The `txbox` command.

Each sub-command lives in its own module exposing ``configure(parser)`` and
``run(args) -> int``; only the chosen one is imported, so `txbox --help` stays fast and
`txbox migrate` never loads Spark or the web stack.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from framework import redaction
from framework.errors import TxboxError

# name → (module, one-line help). The public command names first.
COMMANDS: dict[str, tuple[str, str]] = {
    "migrate": ("framework.cli.migrate", "apply the framework's migrations (--sql prints them)"),
    "topology": ("framework.cli.topology", "declare exchanges, queues and bindings"),
    "check": ("framework.cli.check", "assembly validation and contracts lint"),
    "contracts": ("framework.cli.check", "contracts check: lint the folder and show each message's routing"),
    "publisher": ("framework.cli.publisher", "run the outbox publisher daemon"),
    "receiver": ("framework.cli.receiver", "run the inbox receiver daemon"),
    "worker": ("framework.cli.worker", "run the inbox worker daemon"),
    "run": ("framework.cli.run", "run publisher, receiver and worker in one process"),
    "collector": ("framework.cli.collector", "drain <service>:dead_letter into txbox.dead_letters"),
    "dlq": ("framework.cli.dlq", "dead letters: list / show / replay / discard"),
    "outbox": ("framework.cli.pending", "what the outbox still holds: list (state, age, attempts, last error)"),
    "inbox": ("framework.cli.pending", "what the inbox still holds: list (state, age, attempts, last error)"),
    "dashboard": ("framework.cli.dashboard", "the dead-letter and health dashboard (web)"),
    "analyze": ("framework.cli.analyze", "the Spark reconciliation and analytics job"),
    "archive": ("framework.cli.archive", "move old processed/abandoned rows to Parquet"),
    "bench": ("framework.cli.bench", "benchmarks: relay, receiver, worker, e2e, latency, analyze"),
    "demo": ("framework.cli.demo", "the example saga, end to end, with a summary"),
    "chaos": ("framework.cli.chaos", "fault-injection run: kills and restarts under load"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: txbox <command> [options]   (txbox <command> --help for its options)", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name = args[0]
    if name not in COMMANDS:
        print(f"txbox: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"txbox {name}", description=COMMANDS[name][1])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    module.configure(parser, name)
    ns = parser.parse_args(args[1:])
    ns.command = name
    logging.basicConfig(
        level=logging.DEBUG if ns.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not ns.verbose:
        logging.getLogger("pika").setLevel(logging.WARNING)  # pika narrates every socket event
    try:
        redaction.sensitive_keys()  # a bad TXBOX_SENSITIVE_KEYS fails at start, not at the first dead letter
        result: int = module.run(ns)
        return result
    except TxboxError as exc:
        # Our errors carry the fix in their text; a stack trace would only hide it.
        print(f"txbox {name}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `txbox dlq list | head`: the reader left; say nothing more, like other Unix tools.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    raise SystemExit(main())
