"""`txbox check`: assembly validation (with --app) and the contracts lint."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from framework.cli.common import add_service_options, load_service
from framework.contracts import load_registry


def configure(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("--strict", action="store_true", help="warnings fail the check too")
    add_service_options(parser)


def run(args: argparse.Namespace) -> int:
    if args.app or os.environ.get("TXBOX_SERVICE") or args.service:
        service = load_service(args)
        problems = service.problems()
        subject = f"service {service.name} ({len(service.handlers)} handlers)"
    else:
        # No service named: lint the whole contracts folder.
        folder = args.contracts_dir or Path(os.environ.get("TXBOX_CONTRACTS_DIR", "contracts"))
        problems = load_registry(folder, strict=False).problems
        subject = f"contracts in {folder}"
    for p in problems:
        print(p)
    errors = sum(p.severity == "error" for p in problems)
    warnings = len(problems) - errors
    print(f"{subject}: {errors} error(s), {warnings} warning(s)")
    return 1 if errors or (args.strict and warnings) else 0
