"""`txbox new SERVICE`: scaffold a service (contract, handler, migrations, typed payloads, tests)."""

from __future__ import annotations

import argparse
from pathlib import Path

from framework import scaffold


def configure(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("service", help="the service id, e.g. billing-service")
    parser.add_argument(
        "--dir", type=Path, help="the folder to create, a Python package (default: the service id with '_' for '-')"
    )


def run(args: argparse.Namespace) -> int:
    folder: Path = args.dir or Path(args.service.replace("-", "_"))
    written = scaffold.create(folder, args.service)
    package = folder.name
    print(f"{len(written)} files in {folder}/. Next, from {folder.resolve().parent}:")
    print(f"  pytest {folder}                      # its tests, against a throw-away database")
    print(f"  txbox check --app {package}.app:service --generated {folder / 'messages.py'}")
    print(
        f"  txbox codegen --contracts-dir {folder / 'contracts'} --output {folder / 'messages.py'} "
        f"--service {args.service}   # after editing the contract"
    )
    return 0
