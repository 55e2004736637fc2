"""RabbitMQ adapter: connections, and pika errors converted to txbox errors at the boundary."""

from __future__ import annotations

import contextlib
import functools
import random
import re
import struct
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import pika
import pika.data
import pika.exceptions
from pika.adapters.select_connection import IOLoop

from framework.errors import BrokerUnavailable, ConfigurationError
from framework.settings import amqp_urls, mask_url

TABLE_DEPTH_LIMIT = 32
"""Header tables and arrays nested deeper than this are decoded as :data:`TOO_DEEP_FIELD`."""
TOO_DEEP_FIELD = f"<AMQP field nested deeper than {TABLE_DEPTH_LIMIT} levels, not decoded>"
_depth = threading.local()


def _bounded(decode_value: Callable[[bytes, int], tuple[object, int]]) -> Callable[[bytes, int], tuple[object, int]]:
    """pika's field decoder with a depth limit.

    pika decodes header tables recursively: a table nested a few hundred levels deep (a
    frame of RabbitMQ's default size holds thousands) raises RecursionError inside pika,
    which drops the connection; the broker redelivers the same message and every consumer
    fails on it forever. Past the limit a table (``F``) or array (``A``) is skipped by its length
    prefix and decoded as a marker string, so the delivery arrives and can be judged.
    """

    def decode(encoded: bytes, offset: int) -> tuple[object, int]:
        depth = getattr(_depth, "n", 0)
        if depth >= TABLE_DEPTH_LIMIT and encoded[offset : offset + 1] in (b"F", b"A"):
            size = struct.unpack_from(">I", encoded, offset + 1)[0]
            return TOO_DEEP_FIELD, offset + 5 + size
        _depth.n = depth + 1
        try:
            return decode_value(encoded, offset)
        finally:
            _depth.n = depth

    decode.bounded = True  # type: ignore[attr-defined]
    return decode


def bound_decoder_depth() -> None:
    """Install :func:`_bounded` as pika's field decoder, once (see :func:`framework.drivers.tune_drivers`).

    Every pika decoder looks ``decode_value`` up in ``pika.data`` at call time, so the
    one assignment reaches them all; it is process-wide, which is why only a daemon's
    start makes it, never an import (docs/explanation/daemons.md, "What txbox changes in a process").
    """
    if not getattr(pika.data.decode_value, "bounded", False):
        pika.data.decode_value = _bounded(pika.data.decode_value)


#: The heartbeat timeout every connection asks for: the broker closes a connection it has
#: heard nothing from for about this long (and requeues what its consumers held).
HEARTBEAT_SECONDS = 30


def parameters(amqp_url: str, *, name: str = "txbox", heartbeat: int = HEARTBEAT_SECONDS) -> pika.URLParameters:
    try:
        params = pika.URLParameters(amqp_url)
    except Exception as exc:  # pika raises assorted types for bad URLs
        raise ConfigurationError(
            f"TXBOX_AMQP_URL={mask_url(amqp_url)!r} is not valid ({exc}). "
            "Example: TXBOX_AMQP_URL=amqp://guest:guest@127.0.0.1:5672/%2F"
        ) from None
    params.client_properties = {"connection_name": name, "product": "txbox"}
    params.heartbeat = heartbeat
    params.connection_attempts = 1
    params.blocked_connection_timeout = 60
    return params


@functools.cache
def _process_order(amqp_url: str) -> tuple[str, ...]:
    """The URLs of ``TXBOX_AMQP_URL`` in this process's order, drawn once per process."""
    urls = amqp_urls(amqp_url)
    return tuple(random.sample(urls, len(urls)))


def parameters_list(amqp_url: str, *, name: str = "txbox") -> list[pika.URLParameters]:
    """Connection parameters for every node of ``TXBOX_AMQP_URL``, in this process's order.

    The order is shuffled once per process, so the daemons of a deployment spread over a
    cluster's nodes instead of all crowding the first one, while one process keeps
    going back to the node it prefers; a connect tries them in turn
    (docs/explanation/operations.md, "A RabbitMQ cluster").
    """
    return [parameters(url, name=name) for url in _process_order(amqp_url)]


def username(amqp_url: str) -> str:
    """The broker user an AMQP URL logs in as with a password, else "".

    A message we publish carries it as ``user_id``, which RabbitMQ checks against the
    publishing connection's user: receivers trust our control headers on that basis.
    Not for EXTERNAL (certificate) logins, whose user the URL does not name: a wrong
    ``user_id`` would make RabbitMQ close the channel.
    """
    credentials = parameters(amqp_urls(amqp_url)[0]).credentials
    if isinstance(credentials, pika.PlainCredentials):
        return str(credentials.username)
    return ""


def connect(amqp_url: str, *, name: str = "txbox") -> pika.BlockingConnection:
    """A blocking connection to the first node that answers (see :func:`parameters_list`);
    failures become BrokerUnavailable with the URLs (masked)."""
    try:
        return pika.BlockingConnection(parameters_list(amqp_url, name=name))
    except pika.exceptions.ProbableAuthenticationError as exc:
        raise BrokerUnavailable(f"RabbitMQ at {mask_url(amqp_url)} refused the credentials: {exc}") from exc
    except pika.exceptions.AMQPError as exc:
        raise BrokerUnavailable(f"cannot connect to RabbitMQ at {mask_url(amqp_url)}: {exc!r}") from exc


#: What a :class:`pika.SelectConnection` calls back with: the connection, and for the
#: error and close callbacks what failed or closed it.
Opened = Callable[[pika.SelectConnection], None]
Failed = Callable[[pika.SelectConnection, BaseException], None]


def connect_on(
    loop: IOLoop,
    nodes: Iterator[pika.ConnectionParameters],
    *,
    on_open: Opened,
    on_open_error: Failed,
    on_close: Failed,
) -> tuple[pika.SelectConnection | None, BaseException | None]:
    """Start opening a connection on ``loop`` to the next of ``nodes`` (from :func:`parameters_list`).

    Returns at once with the connection being opened and None; its callbacks then run on
    the loop: ``on_open`` once it is open, ``on_open_error`` when the node did not answer
    (call this again for the next node: a connect tries them in turn, docs/explanation/operations.md,
    "A RabbitMQ cluster"), ``on_close`` when an opened connection closed. A node whose
    parameters pika refuses only now counts as one that did not answer. Returns (None, the
    last such refusal or None) once ``nodes`` is used up.
    """
    refused: BaseException | None = None
    for params in nodes:
        try:
            connection = pika.SelectConnection(
                params,
                on_open_callback=on_open,
                on_open_error_callback=on_open_error,
                on_close_callback=on_close,
                custom_ioloop=loop,
            )
        except Exception as exc:  # pika checks some parameters only here
            refused = exc
            continue
        return connection, None
    return None, refused


def ioloop(connection: pika.BlockingConnection) -> Any:
    """The I/O loop under a blocking ``connection``: another socket registered on it
    (``add_handler``) is watched while the connection waits, on the same thread.

    pika keeps it behind the blocking connection's implementation (a SelectConnection,
    whose loop this is); tests/integration/test_receiver_one_thread.py pins the shape.
    """
    return connection._impl.ioloop


def close_quietly(connection: pika.BlockingConnection) -> None:
    """Close a daemon's connection on its way out; one the broker already dropped is gone anyway."""
    if connection.is_open:
        with contextlib.suppress(pika.exceptions.AMQPError):
            connection.close()


@contextmanager
def broker_errors(what: str) -> Iterator[None]:
    try:
        yield
    except pika.exceptions.AMQPConnectionError as exc:
        raise BrokerUnavailable(f"{what}: connection lost ({exc!r})") from exc
    except pika.exceptions.AMQPChannelError as exc:
        raise BrokerUnavailable(f"{what}: channel closed ({exc!r})") from exc


_INEQUIVALENT = re.compile(
    r"inequivalent arg '([^']+)' for (queue|exchange) '([^']+)'.*?received (.+?) but current is (.+)$"
)


def explain_precondition(reply_text: str) -> tuple[str, str, str, str, str] | None:
    """(what, name, argument, wanted, current) out of a PRECONDITION_FAILED reply."""
    match = _INEQUIVALENT.search(reply_text)
    if not match:
        return None
    arg, what, name, wanted, current = match.groups()
    return what, name, arg, wanted.strip(), current.strip()


UNENCODABLE_FIELD = "<AMQP field that cannot be sent again, not copied>"


def encodable_headers(headers: Mapping[str, Any]) -> dict[str, Any]:
    """``headers`` as a copy we publish can carry them: a value pika cannot encode again
    becomes :data:`UNENCODABLE_FIELD`.

    What pika decodes it cannot always encode: a double header of 1e19 or more arrives
    as an int past 64 bits (pika truncates floats to ints), a Decimal with a huge
    exponent does not fit its field. A copy holding one would fail at every publish,
    and its delivery would wait forever (docs/explanation/receive.md, "Receiver intake").
    Checked per top-level header, so one bad value costs only itself.
    """
    out: dict[str, Any] = {}
    for name, value in headers.items():
        try:
            pika.data.encode_value([], value)
        except Exception:  # struct.error, OverflowError, unsupported types: whatever pika raises
            value = UNENCODABLE_FIELD
        out[name] = value
    return out
