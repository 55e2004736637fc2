"""The faststream-outbox relay under load: outbox rows -> RabbitMQ, confirmed.

Runs in the peer's own virtualenv (made by run.py in a scratch folder), uses only the
package's public API, as its README's relay quickstart does: an OutboxBroker subscriber
on the outbox table stacked under a RabbitBroker publisher. The handler returns the
body; FastStream publishes it (publisher confirms on, persistent) and the worker then
deletes the row.

Protocol with run.py: argv[1] is a JSON config; the program fills the outbox with
``messages`` rows through ``OutboxBroker.publish_batch``, connects to RabbitMQ, prints
READY, waits for a GO line on stdin, starts the subscriber, and stops on a STOP line
(or end of input).
"""

import asyncio
import json
import sys

from faststream.rabbit import ExchangeType, RabbitBroker, RabbitExchange
from faststream_outbox import OutboxBroker, make_outbox_table
from sqlalchemy import MetaData
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

QUEUE = "bench_relay"


async def line() -> str:
    return await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)


async def main() -> None:
    cfg = json.loads(sys.argv[1])
    workers = cfg["max_workers"]
    engine = create_async_engine(cfg["database_url"], pool_size=workers + 4, max_overflow=4)
    metadata = MetaData()
    table = make_outbox_table(metadata, table_name="outbox")
    async with engine.begin() as conn:
        await conn.run_sync(metadata.create_all)

    outbox = OutboxBroker(engine, outbox_table=table, logger=None)
    rabbit = RabbitBroker(cfg["amqp_url"], logger=None)
    exchange = RabbitExchange(cfg["exchange"], type=ExchangeType.TOPIC, declare=False)
    publisher = rabbit.publisher(exchange=exchange, routing_key=cfg["routing_key"])

    @publisher
    @outbox.subscriber(
        QUEUE,
        max_workers=workers,
        fetch_batch_size=cfg["fetch_batch_size"],
        min_fetch_interval=cfg["min_fetch_interval"],
        max_fetch_interval=cfg["max_fetch_interval"],
        terminal_flush_batch_size=cfg["terminal_flush_batch_size"],
    )
    async def relay(body: dict) -> dict:  # type: ignore[type-arg]
        return body

    # Fill the outbox the peer's way: publish_batch inside the caller's transaction.
    sessions = async_sessionmaker(engine, expire_on_commit=False)
    body = cfg["body"]
    left = cfg["messages"]
    while left:
        chunk = min(left, 1000)
        async with sessions() as session, session.begin():
            await outbox.publish_batch(*([body] * chunk), queue=QUEUE, session=session)
        left -= chunk

    await rabbit.connect()
    print("READY", flush=True)
    if (await line()).strip() != "GO":
        return
    await outbox.start()
    await line()  # STOP or end of input
    await outbox.stop()
    await rabbit.stop()
    await engine.dispose()


asyncio.run(main())
