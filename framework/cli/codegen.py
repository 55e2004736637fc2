"""`txbox codegen`: typed payload classes (TypedDicts) from the contracts."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from framework import codegen


def configure(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument(
        "--output", "-o", type=Path, required=True, help="the Python module to write (e.g. messages.py)"
    )
    parser.add_argument(
        "--contracts-dir",
        type=Path,
        default=Path(os.environ.get("TXBOX_CONTRACTS_DIR", "contracts")),
        help="contracts folder (TXBOX_CONTRACTS_DIR; default: contracts)",
    )
    parser.add_argument(
        "--service",
        action="append",
        default=[],
        help="only the messages this service receives and emits (repeat for more); default: every message",
    )
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if the module is stale")


def run(args: argparse.Namespace) -> int:
    if args.check:
        why = codegen.stale(args.output)
        print(why or f"{args.output} is up to date")
        return 1 if why else 0
    changed = codegen.write(args.output, args.contracts_dir, args.service)
    print(f"{args.output} {'written' if changed else 'is up to date'}")
    return 0
