"""`txbox check` (assembly validation with --app, else the contracts lint) and
`txbox contracts check` (the lint, with the routing of every message as it goes on the wire)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from framework import names
from framework.cli.common import (
    add_service_options,
    add_tenant_options,
    load_service,
    load_tenants,
    picked_tenants,
    quiet_alembic,
    tenant_settings,
)
from framework.contracts import Registry, load_registry, topic_matches
from framework.errors import Problem, TenantRegistryError

ROUTING_RULE = (
    "routing (Mosaic's rule): a command goes to exchange `command` with routing key "
    "`<consumer service id>.<channel>`, an event to exchange `event` with "
    "`<producer service id>.<channel>`; a contract's channel names are `entity.action`, its "
    "service id is `x-service-id`, and a service receives another service's events by listing "
    "their keys, `<producer service id>.<channel>`, under `x-subscribes`."
)


def configure(parser: argparse.ArgumentParser, name: str) -> None:
    if name == "contracts":
        parser.add_argument("action", choices=("check",), help="check: lint the folder and show the routing")
    parser.add_argument("--strict", action="store_true", help="warnings fail the check too")
    parser.add_argument(
        "--generated",
        action="append",
        type=Path,
        default=[],
        help="a module written by txbox codegen: an error if the contracts changed since (repeatable)",
    )
    add_service_options(parser)
    if name != "contracts":
        add_tenant_options(parser)


def run(args: argparse.Namespace) -> int:
    if args.command != "contracts" and (args.app or os.environ.get("TXBOX_SERVICE") or args.service):
        service = load_service(args)
        problems = service.problems()
        subject = f"service {service.name} ({len(service.handlers)} handlers)"
    else:
        # No service named: lint the whole contracts folder.
        folder = args.contracts_dir or Path(os.environ.get("TXBOX_CONTRACTS_DIR", "contracts"))
        registry = load_registry(folder, strict=False)
        problems = registry.problems
        subject = f"contracts in {folder}"
        print(routing_report(registry))
    problems = [*problems, *stale_code(args.generated)]
    failed_tenants = check_tenants(args, problems) if args.command != "contracts" else 0
    return report(problems, subject, strict=args.strict) or (1 if failed_tenants else 0)


def check_tenants(args: argparse.Namespace, problems: list[Problem]) -> int:
    """With a tenant registry: that it loads (its problems join ``problems``) and that each
    tenant's database answers with its framework tables at head, a line each. The number
    of tenants that failed (docs/explanation/operations.md, "Tenants: the registry")."""
    settings = tenant_settings(args)
    if not settings.configured:
        return 0
    quiet_alembic(args)
    from framework.tenants.runs import check_all

    try:
        registry = load_tenants(args, settings)
    except TenantRegistryError as exc:
        problems.extend(Problem("error", "tenant registry", p) for p in exc.problems)
        return 0
    chosen = picked_tenants(registry, args.tenant)
    print(f"checking {len(chosen)} of {len(registry)} tenants of {registry.source}")
    outcomes = check_all(chosen, jobs=settings.tenants_jobs, report=lambda outcome: print(outcome, flush=True))
    failed = sorted(o.tenant.key for o in outcomes if not o.ok)
    shown = ", ".join(failed[:20]) + (", …" if len(failed) > 20 else "")
    print(f"tenants: {len(outcomes) - len(failed)} ok, {len(failed)} failed" + (f" ({shown})" if failed else ""))
    return len(failed)


def stale_code(paths: list[Path]) -> list[Problem]:
    from framework import codegen

    return [Problem("error", str(path), why) for path in paths if (why := codegen.stale(path)) is not None]


def report(problems: list[Problem], subject: str, *, strict: bool) -> int:
    for p in problems:
        print(p)
    errors = sum(p.severity == "error" for p in problems)
    warnings = len(problems) - errors
    print(f"{subject}: {errors} error(s), {warnings} warning(s)")
    return 1 if errors or (strict and warnings) else 0


def routing_report(registry: Registry) -> str:
    """Every message of every service with the exchange and routing key it travels with."""
    aliases: dict[str, list[str]] = {}
    for alias, message_type in registry.aliases.items():
        aliases.setdefault(message_type, []).append(alias)
    lines = [ROUTING_RULE]
    for service, contract in sorted(registry.services.items()):
        files = f"; from {', '.join(map(str, contract.paths))}" if len(contract.paths) > 1 else ""
        lines.append(f"  {service} (queue {names.inbox_queue(service)}{files}):")
        for spec in [*contract.commands, *contract.events]:
            also = (
                f" (also accepted as {', '.join(sorted(aliases[spec.message_type]))})"
                if spec.message_type in aliases
                else ""
            )
            verb = "accepts" if spec.kind == "command" else "emits"
            versions = f" (versions {', '.join(spec.versions)})" if spec.versions else ""
            lines.append(
                f"    {verb} {spec.kind} {spec.message_type}{versions}{also}: "
                f"{names.exchange_for(spec.kind)} / {spec.routing_key}"
            )
        for pattern in contract.subscribes:
            matched = sorted(
                s.message_type
                for s in registry.messages.values()
                if s.kind == "event" and topic_matches(pattern, s.routing_key)
            )
            lines.append(
                f"    subscribes: {names.EVENT_EXCHANGE} / {pattern} → {', '.join(matched) or 'no loaded event'}"
            )
    return "\n".join(lines)
