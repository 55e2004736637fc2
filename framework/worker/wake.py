"""What wakes the worker between batches: LISTEN, on one session per database, read on the loop.

No listener thread (docs/explanation/daemons.md, "Wake-ups"): the workers of a process
that share a database (a worker alone, or the tenants of one database, each in a schema
of its own) share one ``LISTEN`` session of :class:`Listeners`, whose socket is a handler
of their loop (docs/explanation/daemons.md, "One loop per process"). Each worker's
:class:`Notifications` LISTENs there on ``<schema>_inbox_insert`` (or on its help
channel), and the session hands each NOTIFY to the worker of its channel, which claims
when :class:`framework.wakeup.Pace` says (the window and the hold, timers of that loop).
Before each claim the worker reads the NOTIFYs already on the socket: the claim's
snapshot covers their rows, so they wake no claim after it. N tenants in one database
hold one LISTEN connection between them, not N (docs/how-to/tenants.md, "One set of
daemons for every tenant").
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import psycopg
from pika.adapters.select_connection import IOLoop
from psycopg import sql

from framework import db
from framework.worker.counts import Counts

log = logging.getLogger("txbox.worker")

OnNotify = Callable[[int], None]


class Listeners:
    """The LISTEN sessions of one loop, one per database URL, shared by the
    :class:`Notifications` that name it; each closes when its last one does. Every
    method runs on the loop's thread."""

    def __init__(self) -> None:
        self._sessions: dict[str, _Session] = {}

    def session(self, database_url: str, loop: IOLoop) -> _Session:
        """The session of ``database_url`` on ``loop``, made on first use (not connected yet)."""
        session = self._sessions.get(database_url)
        if session is None:
            session = self._sessions[database_url] = _Session(self, database_url, loop)
        assert session.loop is loop, "the workers sharing a LISTEN session run on one loop"
        return session

    def forget(self, session: _Session) -> None:
        """``session`` closed with its last member: the next worker of its database gets a new one."""
        if self._sessions.get(session.url) is session:
            del self._sessions[session.url]


class _Session:
    """One LISTEN connection: the channels its members listen on (each LISTENed once),
    the advisory locks it holds for them, and the socket the loop watches. What each
    member holds is the session's to know: :meth:`leave` gives back exactly that. A
    NOTIFY goes to every member on its channel; a broken connection is closed and told
    to the members that listened on it (``-1``), each of which listens again at its next
    cycle."""

    def __init__(self, owner: Listeners, database_url: str, loop: IOLoop) -> None:
        self.owner = owner
        self.url = database_url
        self.loop = loop
        self.members: list[Notifications] = []
        self.generation = 0  # a new one per connection: a member listens on the one it opened on
        self._conn: psycopg.Connection[Any] | None = None
        self._fd: int | None = None
        self._channels: dict[str, list[Notifications]] = {}  # LISTENed now, by channel: who hears it
        self._locks: dict[int, Notifications] = {}  # advisory lock keys held, by the member each is for
        self._heard_by: list[Notifications] = []  # the members whose ``pending`` is not 0

    @property
    def connected(self) -> bool:
        return self._conn is not None and not self._conn.closed

    def connect(self) -> None:
        """Connected (raises DatabaseUnavailable), the loop watching the socket."""
        if self.connected:
            return
        self.close()
        conn = db.connect(self.url, autocommit=True, application_name="txbox-worker-listen")
        try:
            # NOTIFYs psycopg reads while a statement of ours runs come here, not to its backlog.
            conn.add_notify_handler(lambda notify: self._heard(notify.channel))
            fd = conn.pgconn.socket
            self.loop.add_handler(fd, self._readable, IOLoop.READ)
        except BaseException:
            conn.close()
            raise
        self._conn, self._fd = conn, fd
        self.generation += 1

    def leads(self, member: Notifications) -> bool:
        return member.lock_key is not None and self._locks.get(member.lock_key) is member

    def channels_of(self, member: Notifications) -> tuple[str, ...]:
        return tuple(channel for channel, hearing in self._channels.items() if member in hearing)

    def execute(self, statement: sql.Composed, member: Notifications) -> tuple[Any, ...] | None:
        """Run one statement for ``member`` (counted as its worker's); a broken connection
        is closed and told to every other member, and the OperationalError raised."""
        conn = self._conn
        assert conn is not None, "the session is connected first"
        member.counts.statements += 1
        try:
            cur = conn.execute(statement)
            row = cur.fetchone() if cur.description else None
        except psycopg.OperationalError:
            self.broken(member)
            raise
        # What came during it goes to the others now; ``member``'s own waits for its next read.
        self._hand_on(member)
        return row

    def try_lock(self, key: int, member: Notifications) -> bool:
        """Take ``key`` for ``member``; False if it is taken (here by another member, or by
        another session)."""
        if key in self._locks:
            return self._locks[key] is member
        row = self.execute(sql.SQL("SELECT pg_try_advisory_lock({})").format(sql.Literal(key)), member)
        if row and row[0]:
            self._locks[key] = member
            return True
        return False

    def listen(self, channel: str, member: Notifications) -> None:
        hearing = self._channels.get(channel)
        if hearing is None:
            self.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)), member)
            hearing = self._channels[channel] = []
        if member not in hearing:
            hearing.append(member)

    def unlisten(self, channel: str, member: Notifications) -> None:
        hearing = self._channels.get(channel)
        if hearing is None or member not in hearing:
            return
        hearing.remove(member)
        if not hearing:
            del self._channels[channel]
            self.execute(sql.SQL("UNLISTEN {}").format(sql.Identifier(channel)), member)

    def release(self, member: Notifications) -> None:
        """Give back what ``member`` holds here: its channels and its lock. If that fails
        the connection is closed (which gives them back) and told to the others."""
        try:
            for channel in self.channels_of(member):
                self.unlisten(channel, member)
            for key in [k for k, holder in self._locks.items() if holder is member]:
                del self._locks[key]
                self.execute(sql.SQL("SELECT pg_advisory_unlock({})").format(sql.Literal(key)), member)
        except psycopg.OperationalError:
            pass  # broken: closed and told to the others already
        except Exception:
            self.broken(member)

    def read(self, caller: Notifications | None = None) -> int:
        """Read what is on the socket; every NOTIFY counts to the members on its channel.
        Each member but ``caller`` is told its count at once; ``caller``'s is returned
        (-1, and -1 to the others, if the connection broke: it is closed)."""
        conn = self._conn
        if conn is None:
            return 0
        pgconn = conn.pgconn
        try:
            pgconn.consume_input()
            while (notify := pgconn.notifies()) is not None:
                self._heard(notify.relname.decode(errors="replace"))
        except psycopg.OperationalError:
            self.broken(caller)
            return -1
        if conn.closed:  # libpq may mark the connection bad without raising
            self.broken(caller)
            return -1
        self._hand_on(caller)
        if caller is None or not caller.pending:
            return 0
        own, caller.pending = caller.pending, 0
        self._heard_by.remove(caller)
        return own

    def _heard(self, channel: str) -> None:
        for member in self._channels.get(channel, ()):
            if not member.pending:
                self._heard_by.append(member)
            member.pending += 1

    def _hand_on(self, caller: Notifications | None) -> None:
        """Each member's NOTIFYs to it (``on_notify``) but ``caller``'s, which wait for its
        read: only the members that heard some, not every member at every drain."""
        heard, self._heard_by = self._heard_by, []
        for member in heard:
            if member is caller:
                self._heard_by.append(member)
            else:
                count, member.pending = member.pending, 0
                _tell(member, count)

    def _readable(self, _fd: int, _events: int) -> None:
        """The socket has data: NOTIFYs, or the connection's end. Its last resort: a failure
        here is a lost connection, which every member listens on again at its next cycle."""
        try:
            self.read()
        except Exception:
            log.warning("reading the LISTEN connection failed: closing it", exc_info=True)
            self.broken()

    def broken(self, caller: Notifications | None = None) -> None:
        """The connection is lost: closed, and the members that listened on it but ``caller``
        told (-1); those in a backoff of their own, not listening, are left to it."""
        # By generation: the connection is marked bad already, so no member is ``listening``.
        listened = [m for m in self.members if m.generation == self.generation and m is not caller]
        self.close()
        for member in listened:
            _tell(member, -1)

    def leave(self, member: Notifications) -> None:
        """``member`` stops listening: what it holds goes back (the connection closes
        after its last member)."""
        if member in self.members:
            self.members.remove(member)
        if member in self._heard_by:
            self._heard_by.remove(member)
        if not self.members:
            self.close()
            self.owner.forget(self)
        elif self.connected:
            self.release(member)

    def close(self) -> None:
        """Close the connection (which ends the locks it held), the loop no longer watching it."""
        fd, self._fd = self._fd, None
        if fd is not None:
            # libpq may have closed the socket on a fatal error already: nothing left to remove.
            with contextlib.suppress(OSError, KeyError, ValueError):
                self.loop.remove_handler(fd)
        if self._conn is not None:
            with contextlib.suppress(Exception):  # a broken connection may fail to close: gone either way
                self._conn.close()
            self._conn = None
        self._channels.clear()
        self._locks.clear()
        for member in self._heard_by:  # what they heard on it is for rows their next claim sees
            member.pending = 0
        self._heard_by.clear()


def _tell(member: Notifications, count: int) -> None:
    """``member``'s worker hears ``count``; its failure is its own, never the session's."""
    try:
        member.on_notify(count)
    except Exception:
        log.warning("a worker failed to take its NOTIFYs", exc_info=True)


class Notifications:
    """One worker's ``LISTEN`` on its database's shared session (:class:`Listeners`),
    read without blocking; with ``help_channel`` and ``lock_key``, one replica of a
    service listens on ``channel`` and the others on ``help_channel``
    (docs/explanation/daemons.md, "Wake-ups" and "Replicas of every daemon").

    The *listener* is the replica whose LISTEN session holds the session advisory lock
    ``lock_key``: it LISTENs on ``channel`` (the inserts) and, when a claim of its came
    back full, :meth:`call_for_help` NOTIFYs ``help_channel``. The others LISTEN on
    ``help_channel`` only, claim at their poll interval, and :meth:`take_turn` takes the
    lock when it is free (the listener's session ended: a stop, a crash, a ``kill -9``,
    a broken connection), moving their LISTEN to ``channel``. Keys are per schema, so
    the tenants sharing a session each have a listener of their own.

    NOTIFYs that come while the worker is not reading reach it through ``on_notify``
    (their count; -1 when the connection it listened on broke). A NOTIFY is only a hint
    to look now: the worker still polls, so one lost while the connection is down costs
    at most a poll interval. :meth:`open` says when it just (re)listened, since rows may
    have come while nobody listened. NOTIFYs read during one of its own statements wait
    for its next :meth:`drain`, which the worker runs before each claim and each wait.
    """

    def __init__(
        self,
        database_url: str,
        channel: str,
        *,
        help_channel: str | None = None,
        lock_key: int | None = None,
        counts: Counts | None = None,
        listeners: Listeners | None = None,
        on_notify: OnNotify = lambda _count: None,
    ) -> None:
        self._url = database_url
        self._listeners = listeners if listeners is not None else Listeners()  # alone: a session of its own
        self._channel = channel
        self._help = help_channel
        self.lock_key = lock_key if help_channel is not None else None
        self.counts = counts or Counts()  # the statements sent here count with the worker's
        self.on_notify = on_notify  # on the loop: NOTIFYs for this worker read while it was not reading
        self._session: _Session | None = None
        self.generation = -1  # the session's connection (its generation) this one listens on
        self.pending = 0  # NOTIFYs read for this worker and not handed on yet (the session's)
        self.tried_at = float("-inf")  # monotonic: the last try for the lock

    @property
    def listening(self) -> bool:
        session = self._session
        return session is not None and session.connected and session.generation == self.generation

    @property
    def leading(self) -> bool:
        """It LISTENs on ``channel``: it holds the lock, or there is none."""
        session = self._session
        return self.listening and session is not None and (self.lock_key is None or session.leads(self))

    def open(self, loop: IOLoop) -> bool:
        """LISTEN if not listening (on ``channel`` if the lock was free or there is none,
        else on ``help_channel``), on its database's session of ``loop``; True if it just
        began (raises DatabaseUnavailable, or what the statements raised, having given
        back what it took)."""
        if self.listening:
            return False
        session = self._session
        if session is None:
            session = self._session = self._listeners.session(self._url, loop)
            session.members.append(self)
        session.connect()
        try:
            if self.lock_key is not None:
                self.tried_at = time.monotonic()
            leading = self.lock_key is None or session.try_lock(self.lock_key, self)
            session.listen(self._channel if leading else self._help or self._channel, self)
        except BaseException:
            if session.connected:
                session.release(self)
            raise
        self.generation = session.generation
        return True

    def take_turn(self, every: float) -> bool:
        """For a replica that is not the listener, at most once per ``every`` seconds: take
        the lock if it is free and LISTEN on ``channel`` instead of ``help_channel``. True
        if this replica just became the listener (it must claim now: rows may have come
        while nobody listened). A broken connection is closed (:meth:`open` again)."""
        session = self._session
        now = time.monotonic()
        if session is None or self.leading or not self.listening or self._help is None or self.lock_key is None:
            return False
        if now - self.tried_at < every:
            return False
        self.tried_at = now
        try:
            if not session.try_lock(self.lock_key, self):
                return False
            session.unlisten(self._help, self)
            session.listen(self._channel, self)
        except psycopg.OperationalError:
            return False  # closed: the next drain says so, the next cycle listens again
        return True

    def call_for_help(self) -> None:
        """The listener's claim came back full: NOTIFY ``help_channel``, so the others claim
        too. Nothing for a replica that is not the listener, or with no help channel."""
        session = self._session
        if session is None or not self.leading or self._help is None:
            return
        # A broken connection is closed: the next drain says so, the next cycle listens
        # again, the next poll claims.
        with contextlib.suppress(psycopg.OperationalError):
            session.execute(sql.SQL("NOTIFY {}").format(sql.Identifier(self._help)), self)

    def drain(self) -> int:
        """The NOTIFYs for this worker that arrived; -1 if the connection it listened on
        broke (it is closed: listen again)."""
        session = self._session
        if session is None:
            return 0
        if not self.listening:
            return -1 if self.generation >= 0 else 0
        return session.read(self)

    def close(self) -> None:
        """Stop listening: what it holds goes back to the session (which closes when no
        worker is left on it, and the lock with it)."""
        if self._session is not None:
            self._session.leave(self)
        self._session = None
        self.generation = -1
        self.pending = 0
