"""`txbox bench outbox-write`: what writing one outbox row adds to a business transaction.

Both variants are commit-bound one-row business transactions through a SQLAlchemy
Session, as a user writes them; the raw limit is the business transaction alone,
measured in the same run and interleaved in rounds so machine noise hits both alike.
Bar (docs/explanation/benchmarks.md): with the outbox row the rate is at least 1/1.25 = 0.8 of the raw one.
``--async`` measures the same through an ``AsyncSession`` on the psycopg asyncio driver,
against an async one-row business transaction (docs/explanation/write.md, "Async outbox").
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import uuid
from pathlib import Path

import psycopg
from psycopg import sql
from sqlalchemy import Column, MetaData, Table, Text
from sqlalchemy.engine import Engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from framework import migrate
from framework.db import conninfo, create_engine
from framework.service import Service
from framework.settings import Settings
from txbox_tools import repository
from txbox_tools.bench.result import Result

ADMIN_URL = os.environ.get("TXBOX_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
_business = MetaData()
_orders = Table("bench_orders", _business, Column("id", Text, primary_key=True), Column("customer", Text))
PAYLOAD = {"customer": "ada", "sku": "SKU-1", "quantity": 1}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--transactions", type=int, default=4000, help="transactions per variant")
    parser.add_argument("--rounds", type=int, default=8, help="alternations between the variants")
    parser.add_argument("--contracts-dir", type=Path, help="(default: the repository's contracts/)")
    parser.add_argument(
        "--async",
        dest="asyncio",
        action="store_true",
        help="both variants through an AsyncSession (psycopg's asyncio driver)",
    )


def run(args: argparse.Namespace) -> Result:
    name = f"txbox_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    url = "postgresql+psycopg" + url[url.index(":") :]
    try:
        migrate.upgrade(url)
        service = Service(
            settings=Settings(
                service="order-service", database_url=url, contracts_dir=args.contracts_dir or repository.contracts()
            )
        )
        service.registry  # noqa: B018 - load contracts before timing
        engine = create_engine(url, pool_size=1)
        _business.create_all(engine)
        per_round = max(1, args.transactions // args.rounds)
        if args.asyncio:
            plain, with_outbox = asyncio.run(_rounds_async(url, service, per_round, args.rounds))
        else:
            plain = with_outbox = 0.0
            for _ in range(args.rounds):
                plain += _time(engine, service, per_round, outbox=False)
                with_outbox += _time(engine, service, per_round, outbox=True)
        engine.dispose()
        total = per_round * args.rounds
        return Result(
            stage="outbox-write-async" if args.asyncio else "outbox-write",
            messages=total,
            seconds=with_outbox,
            raw_limit_rate=total / plain,
            raw_limit="the same one-row business transaction without the outbox row"
            + (" (AsyncSession)" if args.asyncio else ""),
            extra={"overhead_factor": round(with_outbox / plain, 3), "bar_overhead_factor": 1.25},
        )
    finally:
        with psycopg.connect(conninfo(ADMIN_URL), autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def _time(engine: Engine, service: Service, count: int, *, outbox: bool) -> float:
    start = time.perf_counter()
    for _ in range(count):
        order_id = uuid.uuid4().hex
        with Session(engine) as session, session.begin():
            session.execute(_orders.insert().values(id=order_id, customer="ada"))
            if outbox:
                service.outbox(session).send_command("PlaceOrder", aggregate_id=order_id, payload=PAYLOAD)
    return time.perf_counter() - start


async def _rounds_async(url: str, service: Service, per_round: int, rounds: int) -> tuple[float, float]:
    engine = create_async_engine(url, pool_size=1)
    try:
        plain = with_outbox = 0.0
        for _ in range(rounds):
            plain += await _time_async(engine, service, per_round, outbox=False)
            with_outbox += await _time_async(engine, service, per_round, outbox=True)
        return plain, with_outbox
    finally:
        await engine.dispose()


async def _time_async(engine: AsyncEngine, service: Service, count: int, *, outbox: bool) -> float:
    start = time.perf_counter()
    for _ in range(count):
        order_id = uuid.uuid4().hex
        async with AsyncSession(engine) as session, session.begin():
            await session.execute(_orders.insert().values(id=order_id, customer="ada"))
            if outbox:
                service.outbox(session).send_command("PlaceOrder", aggregate_id=order_id, payload=PAYLOAD)
    return time.perf_counter() - start
