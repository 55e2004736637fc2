"""Private PostgreSQL and RabbitMQ instances that a test or a chaos run owns outright.

Restarting the machine's shared PostgreSQL or RabbitMQ would break every other test
running beside us, so fault injection needs servers of its own: a PostgreSQL cluster
made with ``initdb`` in a temporary directory and a second RabbitMQ node, each on free
ports of their own. Both keep their default durability (``fsync`` on, persistent
RabbitMQ storage): a durability test on a server that may lose acknowledged writes
would prove nothing.

Use them as context managers::

    with PrivatePostgres() as pg, PrivateRabbit() as rabbit:
        pg.create_database("orders")
        url = pg.url("orders")            # postgresql+psycopg://postgres@127.0.0.1:<port>/orders
        pg.restart()                      # crash-restart (immediate shutdown + WAL recovery)
        pg.terminate_backends("orders")   # pg_terminate_backend on every client connection
        rabbit.restart()                  # graceful stop + start, data kept
        rabbit.close_connections()        # management API: close every client connection

    with PrivateRabbitCluster(3) as cluster:   # three nodes joined into one cluster
        url = cluster.amqp_url()          # every node's URL, comma-separated (TXBOX_AMQP_URL)
        node = cluster.kill_leader([...]) # kill -9 of the node leading those queues
        cluster.bring_back(node)          # it starts again and rejoins
A primary with a synchronous streaming standby, for failover::

    with PrivatePostgres(settings={"synchronous_standby_names": "*"}) as primary:
        with primary.standby() as standby:  # pg_basebackup -R, then started
            primary.wait_for_sync_standby()
            primary.kill()                    # kill -9 of the postmaster and every backend
            standby.promote()                 # pg_ctl promote: the standby takes writes

PostgreSQL runs as the ``postgres`` OS user when we are root (``initdb`` refuses root).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Self

import psycopg
from psycopg import sql

from txbox_tools.errors import InstanceError

PG_BIN = Path(os.environ.get("TXBOX_PG_BIN", "/usr/lib/postgresql/15/bin"))
RABBITMQ_BIN = Path(os.environ.get("TXBOX_RABBITMQ_BIN", "/usr/lib/rabbitmq/bin"))


def free_port() -> int:
    """A TCP port nobody listens on right now (the kernel's choice, so parallel runs differ)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


class NodeExited(InstanceError):
    """A private RabbitMQ node's Erlang VM ended while the node was starting."""


def _log_tail(log: Path | None, lines: int = 15) -> str:
    """The last ``lines`` of a server's log, on lines of their own after a newline ("" if
    none): an error says why the server failed, because a private server's folder is
    removed when it closes."""
    if log is None or not log.exists():
        return ""
    return "\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def _wait(predicate: Any, timeout: float, what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise InstanceError(f"timed out after {timeout:.0f}s waiting for {what}{_log_tail(log)}")
        time.sleep(0.1)


class _Instance:
    """A private server: ``with`` starts it (closing what a failed start left) and closes it."""

    def start(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PrivatePostgres(_Instance):
    """A throw-away PostgreSQL cluster on its own port, in its own directory."""

    def __init__(
        self,
        port: int | None = None,
        base_dir: Path | None = None,
        max_connections: int = 200,
        settings: Mapping[str, str] | None = None,
    ) -> None:
        self.port = port or free_port()
        self.settings = dict(settings or {})  # written to postgresql.conf before the first start
        self._own_dir = base_dir is None
        self.base_dir = base_dir or Path(tempfile.mkdtemp(prefix="txbox-pg-"))
        self.data_dir = self.base_dir / "data"
        self.log_file = self.base_dir / "postgres.log"
        self.max_connections = max_connections
        self.restarts = 0
        self._user = "postgres" if os.geteuid() == 0 else None

    # --- lifecycle --------------------------------------------------------------------

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = [str(PG_BIN / args[0]), *args[1:]]
        if self._user:
            cmd = ["runuser", "-u", self._user, "--", *cmd]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=self.base_dir, check=False)
        if check and proc.returncode != 0:
            raise InstanceError(f"{' '.join(args[:2])} failed ({proc.returncode}): {proc.stderr or proc.stdout}")
        return proc

    def _own_base_dir(self) -> None:
        if self._user:
            uid = pwd.getpwnam(self._user)
            os.chown(self.base_dir, uid.pw_uid, uid.pw_gid)

    def init(self) -> None:
        self._own_base_dir()
        # --no-sync only skips flushing initdb's own files once; the server keeps fsync on.
        # initdb's pg_hba.conf lets local replication connections in (trust), as pg_basebackup needs.
        self._run("initdb", "-D", str(self.data_dir), "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync")
        self._write_settings()

    def _write_settings(self) -> None:
        """Append :attr:`settings` to postgresql.conf (the last line of a name wins)."""
        if not self.settings:
            return
        lines = "".join(f"{name} = '{value.replace(chr(39), chr(39) * 2)}'\n" for name, value in self.settings.items())
        with (self.data_dir / "postgresql.conf").open("a") as conf:
            conf.write(lines)

    def standby(self, settings: Mapping[str, str] | None = None) -> PrivatePostgres:
        """A streaming standby of this running server: ``pg_basebackup -R`` (so it follows
        this one), on its own port and directory; a context manager that starts it.

        It never asks for a synchronous standby itself (``synchronous_standby_names`` is
        cleared unless ``settings`` say otherwise): once promoted with nobody behind it,
        every commit would wait forever.
        """
        replica = PrivatePostgres(
            max_connections=self.max_connections, settings={"synchronous_standby_names": "", **(settings or {})}
        )
        replica._own_base_dir()
        replica._run(
            "pg_basebackup",
            *("-D", str(replica.data_dir), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres"),
            *("-R", "-X", "stream", "-c", "fast", "--no-sync"),
        )
        replica._write_settings()
        return replica

    def start(self) -> None:
        if not self.data_dir.exists():
            self.init()
        options = (
            f"-p {self.port} -k {self.base_dir} -c listen_addresses=127.0.0.1 "
            f"-c max_connections={self.max_connections} -c fsync=on -c synchronous_commit=on"
        )
        self._run(
            "pg_ctl", "-D", str(self.data_dir), "-l", str(self.log_file), "-o", options, "-w", "-t", "60", "start"
        )
        _wait(self.accepts_connections, 60, f"PostgreSQL on port {self.port}", self.log_file)

    def stop(self, mode: str = "fast") -> None:
        """``fast`` (clean) or ``immediate`` (no checkpoint: recovery replays the WAL, as after a crash)."""
        if self.running():
            self._run("pg_ctl", "-D", str(self.data_dir), "-m", mode, "-w", "-t", "60", "stop")

    def restart(self, mode: str = "immediate") -> None:
        self.stop(mode)
        self.start()
        self.restarts += 1

    def kill(self) -> None:
        """``kill -9`` of the postmaster and all its backends at once, as a power cut would.

        ``pg_ctl`` starts the postmaster in a session of its own, so its process group is
        exactly the server. Nothing is shut down cleanly; the data directory stays.
        """
        pid_file = self.data_dir / "postmaster.pid"
        if not self.running():
            return
        pid = int(pid_file.read_text().split("\n", 1)[0])
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        _wait(lambda: not self.running(), 30, f"PostgreSQL on port {self.port} to die")

    def promote(self) -> None:
        """``pg_ctl promote`` of a standby, waiting until it takes writes."""
        self._run("pg_ctl", "-D", str(self.data_dir), "-w", "-t", "60", "promote")

    def in_recovery(self) -> bool:
        with psycopg.connect(self.admin_url, connect_timeout=5) as conn:
            row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
        return bool(row and row[0])

    def wait_for_sync_standby(self, timeout: float = 60) -> None:
        """Until a standby streams from this server as a synchronous one (commits wait for it)."""

        def synchronous() -> bool:
            with psycopg.connect(self.admin_url, connect_timeout=5) as conn:
                row = conn.execute(
                    "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming' AND sync_state = 'sync'"
                ).fetchone()
            return bool(row and row[0])

        _wait(synchronous, timeout, f"a synchronous standby of PostgreSQL on port {self.port}", self.log_file)

    def running(self) -> bool:
        return (self.data_dir / "postmaster.pid").exists() and self._run(
            "pg_ctl", "-D", str(self.data_dir), "status", check=False
        ).returncode == 0

    def accepts_connections(self) -> bool:
        try:
            with psycopg.connect(self.admin_url, connect_timeout=2):
                return True
        except psycopg.OperationalError:
            return False

    def close(self) -> None:
        try:
            self.stop("immediate")
        finally:
            if self._own_dir:
                shutil.rmtree(self.base_dir, ignore_errors=True)

    # --- use --------------------------------------------------------------------------

    @property
    def admin_url(self) -> str:
        """libpq URL of the ``postgres`` database (psycopg)."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def url(self, database: str, driver: str = "postgresql+psycopg") -> str:
        """SQLAlchemy URL of ``database`` (the form TXBOX_DATABASE_URL takes)."""
        return f"{driver}://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.url(name)

    def terminate_backends(self, database: str | None = None) -> int:
        """Kill client connections from the server side (pg_terminate_backend); returns how many."""
        query = (
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE pid <> pg_backend_pid() AND backend_type = 'client backend'"
        )
        params: tuple[Any, ...] = ()
        if database is not None:
            query += " AND datname = %s"
            params = (database,)
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            row = conn.execute(query, params).fetchone()
        return int(row[0]) if row else 0


class _Management(_Instance):
    """What the chaos run asks of a broker's management API, for one node or a cluster."""

    def api(self, method: str, path: str, body: Any = None) -> Any:
        raise NotImplementedError

    def connections(self) -> list[dict[str, Any]]:
        return list(self.api("GET", "/connections") or [])

    def close_connections(self, name_contains: str = "") -> int:
        """Force-close client connections from the broker side; returns how many."""
        closed = 0
        for conn in self.connections():
            name = conn.get("client_properties", {}).get("connection_name", "") or ""
            if name_contains in name:
                self.api("DELETE", f"/connections/{urllib.parse.quote(conn['name'], safe='')}")
                closed += 1
        return closed

    def queue(self, name: str, vhost: str = "/") -> Any:
        q = urllib.parse.quote
        return self.api("GET", f"/queues/{q(vhost, safe='')}/{q(name, safe='')}")


class PrivateRabbit(_Management):
    """A second RabbitMQ node on this machine: own node name, ports, data and cookie.

    Runs ``rabbitmq-server`` in the foreground as our child (its own process group), so
    stopping it is a signal, not a 5-second ``rabbitmqctl`` round trip. The management
    plugin is on (its API closes connections from the server side). ``cookie`` is the
    Erlang cookie to share with the other nodes of a cluster (else one of its own is
    made on first start); ``small`` keeps the node to one scheduler that does not spin
    while idle, for a machine that runs several nodes beside everything else.
    """

    def __init__(
        self,
        port: int | None = None,
        management_port: int | None = None,
        base_dir: Path | None = None,
        management: bool = True,
        *,
        cookie: str | None = None,
        small: bool = False,
    ) -> None:
        self.port = port or free_port()
        self.dist_port = free_port()
        self.management_port = (management_port or free_port()) if management else None
        # Ports this node chose itself, which it may choose again (see boot).
        self._chosen = (port is None, management_port is None)
        self._own_dir = base_dir is None
        self.base_dir = base_dir or Path(tempfile.mkdtemp(prefix="txbox-rabbit-"))
        self.base_dir.mkdir(parents=True, exist_ok=True)
        self.node = f"txbox-chaos-{self.port}@localhost"
        self.log_file = self.base_dir / "rabbitmq.out"
        self.restarts = 0
        self.boot_failures: list[str] = []  # see restart()
        self.small = small
        self._proc: subprocess.Popen[bytes] | None = None
        self._write_config()
        if cookie is not None:
            path = self.base_dir / ".erlang.cookie"  # HOME is base_dir (see env)
            path.write_text(cookie)
            path.chmod(0o400)  # Erlang refuses a cookie file others may read

    @property
    def description(self) -> str:
        return f"RabbitMQ node {self.node} on :{self.port}"

    def _write_config(self) -> None:
        lines = [f"listeners.tcp.local = 127.0.0.1:{self.port}", "loopback_users = none"]
        plugins = "[]."
        if self.management_port:
            lines += [f"management.tcp.port = {self.management_port}", "management.tcp.ip = 127.0.0.1"]
            plugins = "[rabbitmq_management]."
        (self.base_dir / "rabbitmq.conf").write_text("\n".join(lines) + "\n")
        (self.base_dir / "enabled_plugins").write_text(plugins + "\n")
        (self.base_dir / "rabbitmq-env.conf").write_text("")  # not the machine's /etc one

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            HOME=str(self.base_dir),  # own Erlang cookie, created on first start
            RABBITMQ_CONF_ENV_FILE=str(self.base_dir / "rabbitmq-env.conf"),
            RABBITMQ_NODENAME=self.node,
            RABBITMQ_NODE_PORT=str(self.port),
            RABBITMQ_DIST_PORT=str(self.dist_port),
            RABBITMQ_CONFIG_FILE=str(self.base_dir / "rabbitmq.conf"),
            RABBITMQ_ENABLED_PLUGINS_FILE=str(self.base_dir / "enabled_plugins"),
            RABBITMQ_MNESIA_BASE=str(self.base_dir / "mnesia"),
            RABBITMQ_LOG_BASE=str(self.base_dir / "log"),
            ERL_EPMD_ADDRESS="127.0.0.1",
        )
        if self.small:
            env["RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS"] = "+S 1:1 +sbwt none +sbwtdcpu none +sbwtdio none"
        return env

    def start(self, timeout: float = 90) -> None:
        self.launch()
        self.boot(timeout)

    def boot(self, timeout: float = 90) -> None:
        """Wait for a fresh node's first start (after :meth:`launch`).

        A port is chosen free, then bound by the node seconds later: on a machine running
        other suites beside this one, another process can take it between the two, and the
        node exits with ``eaddrinuse``. A fresh node has nothing to keep, so it chooses its
        own ports (and with them its name) again and starts once more, up to three times;
        a port the caller gave is not changed.
        """
        deadline = time.monotonic() + timeout
        for attempt in range(3):
            try:
                self.wait_ready(max(1.0, deadline - time.monotonic()))
                return
            except NodeExited as exc:
                if attempt == 2 or "eaddrinuse" not in str(exc) or not all(self._chosen):
                    raise
                self.boot_failures.append(str(exc).splitlines()[0])
                self.port, self.dist_port = free_port(), free_port()
                if self.management_port is not None:
                    self.management_port = free_port()
                self.node = f"txbox-chaos-{self.port}@localhost"
                self._write_config()
                self.launch()

    def launch(self) -> None:
        """Start the node without waiting for it (nodes of a cluster boot side by side)."""
        if self._proc is not None and self._proc.poll() is None:
            return
        with self.log_file.open("ab") as out:
            self._proc = subprocess.Popen(
                [str(RABBITMQ_BIN / "rabbitmq-server")],
                env=self.env(),
                cwd=self.base_dir,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def wait_ready(self, timeout: float = 90) -> None:
        _wait(self._ready, timeout, f"RabbitMQ node {self.node} on port {self.port}", self.log_file)

    def ctl(self, *args: str, timeout: float = 120) -> str:
        """``rabbitmqctl -n <this node> args``; InstanceError (with its output) if it fails."""
        try:
            proc = subprocess.run(
                [str(RABBITMQ_BIN / "rabbitmqctl"), "-n", self.node, *args],
                env=self.env(),
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise InstanceError(f"rabbitmqctl {' '.join(args)} on {self.node} took over {timeout:.0f}s") from exc
        if proc.returncode != 0:
            raise InstanceError(f"rabbitmqctl {' '.join(args)} on {self.node} failed: {proc.stderr or proc.stdout}")
        return proc.stdout

    def join(self, seed: str, timeout: float = 120) -> None:
        """Make this (fresh) node a member of the cluster that node ``seed`` belongs to.

        Mnesia now and then fails to start on a node that has just joined (``start_app``:
        ``{badmatch, {error, {normal, {mnesia_app, start, ...}}}}``; RabbitMQ's own test
        suites meet it too). The node is fresh, so it has nothing to lose: it is reset
        (which also takes it out of the seed's view of the cluster) and joins once more.
        """
        deadline = time.monotonic() + timeout
        for attempt in (1, 2):
            left = max(1.0, deadline - time.monotonic())
            try:
                self.ctl("stop_app", timeout=left)
                self.ctl("join_cluster", seed, timeout=left)
                self.ctl("start_app", timeout=left)
                break
            except InstanceError:
                if attempt == 2:
                    raise
                with contextlib.suppress(InstanceError):
                    self.ctl("stop_app", timeout=left)
                self.ctl("reset", timeout=left)
        self.wait_ready(max(1.0, deadline - time.monotonic()))

    def _ready(self) -> bool:
        if self._proc is not None and self._proc.poll() is not None:
            raise NodeExited(
                f"RabbitMQ node {self.node} exited with {self._proc.returncode} during start "
                f"(its script exits 0 whatever ended the Erlang VM); the end of {self.log_file}:"
                + _log_tail(self.log_file, 40)
            )
        if not _port_open(self.port):
            return False
        if self.management_port is None:
            return True
        try:
            overview = self.api("GET", "/overview")
        except (OSError, InstanceError, ValueError):
            return False
        # A port picked free may be another broker's by now (a second run beside this one):
        # only this node's own name on its API, listing its own AMQP listener on that port,
        # says the node answering is ours (the API can be up while the AMQP listener failed).
        if not isinstance(overview, dict) or overview.get("node") != self.node:
            return False
        listeners = overview.get("listeners")
        return isinstance(listeners, list) and any(
            isinstance(item, dict) and item.get("protocol") == "amqp" and item.get("port") == self.port
            for item in listeners
        )

    def stop(self, timeout: float = 60) -> None:
        """Graceful stop (SIGTERM: RabbitMQ closes connections and flushes its stores)."""
        self._signal(signal.SIGTERM, timeout)

    def kill(self) -> None:
        """``kill -9`` of the whole node: confirmed messages must survive it."""
        self._signal(signal.SIGKILL, 30)

    def _signal(self, sig: int, timeout: float) -> None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        # Erlang helpers (epmd is the machine's, shared) may outlive the script briefly.
        _wait(lambda: not _port_open(self.port), 30, f"port {self.port} to close")
        self._proc = None

    def restart(self, hard: bool = False) -> None:
        """Stop (or kill) and start again. A node whose Erlang VM ends while it boots is
        started once more, and the first failure, with the end of its log, is kept in
        :attr:`boot_failures` for the run to report: a CI chaos run met it once after a
        graceful stop, its log gone with the node's folder. The second failure is raised."""
        if hard:
            self.kill()
        else:
            self.stop()
        try:
            self.start()
        except NodeExited as exc:
            self.boot_failures.append(str(exc))
            self.start()  # launch() replaces the exited process
        self.restarts += 1

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def close(self) -> None:
        try:
            self.stop()
        finally:
            if self._own_dir:
                shutil.rmtree(self.base_dir, ignore_errors=True)

    # --- use --------------------------------------------------------------------------

    def amqp_url(self, vhost: str = "/") -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/{urllib.parse.quote(vhost, safe='')}"

    def api(self, method: str, path: str, body: Any = None) -> Any:
        """Call the management API of this node."""
        if self.management_port is None:
            raise InstanceError("this RabbitMQ node runs without the management plugin")
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"http://127.0.0.1:{self.management_port}/api{path}", data=data, method=method)
        req.add_header("Authorization", "Basic " + base64.b64encode(b"guest:guest").decode())
        req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=15) as resp:
                payload = resp.read()
                return json.loads(payload) if payload else None
        except urllib.error.HTTPError as exc:
            if exc.code == 404 and method in ("GET", "DELETE"):
                return None
            raise InstanceError(f"management API {method} {path}: HTTP {exc.code} {exc.reason}") from exc


class PrivateRabbitCluster(_Management):
    """Three (or more) private RabbitMQ nodes joined into one cluster on 127.0.0.1.

    Each node is a :class:`PrivateRabbit` (own node name, ports and data) with a shared
    Erlang cookie, kept small (one scheduler each); they boot side by side, then the
    others join the first, one after the other (``rabbitmqctl stop_app; join_cluster;
    start_app``). Quorum
    queues declared afterwards get a member on every node, so the cluster keeps its
    queues when one node dies: the failover the daemons must survive
    (docs/explanation/operations.md, "A RabbitMQ cluster").
    """

    def __init__(self, size: int = 3, base_dir: Path | None = None) -> None:
        if size < 3:
            raise InstanceError(f"a cluster that outlives one of its nodes needs three at least, not {size}")
        self._own_dir = base_dir is None
        self.base_dir = base_dir or Path(tempfile.mkdtemp(prefix="txbox-rabbit-cluster-"))
        cookie = secrets.token_hex(20)
        self.nodes = [
            PrivateRabbit(base_dir=self.base_dir / f"node{n}", cookie=cookie, small=True) for n in range(1, size + 1)
        ]
        self.restarts = 0  # rolling restarts of every node
        self.node_kills = 0
        self.lost: list[PrivateRabbit] = []  # killed for good (lose_leader): never started again

    @property
    def description(self) -> str:
        ports = ", ".join(f":{node.port}" for node in self.nodes)
        return f"RabbitMQ cluster of {len(self.nodes)} nodes on {ports}"

    def start(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            node.launch()
        for node in self.nodes:
            node.boot(max(1.0, deadline - time.monotonic()))
        # One join at a time: nodes joining side by side is where Mnesia's start fails most.
        seed = self.nodes[0].node
        for node in self.nodes[1:]:
            node.join(seed, max(1.0, deadline - time.monotonic()))
        self.wait_complete(max(1.0, deadline - time.monotonic()))

    def running_members(self) -> set[str]:
        """Names of the cluster's nodes that run, as one of them sees it."""
        return {n["name"] for n in self.api("GET", "/nodes") or [] if n.get("running")}

    def wait_complete(self, timeout: float = 120) -> None:
        want = {node.node for node in self.nodes if node not in self.lost}
        _wait(lambda: _safe(self.running_members) == want, timeout, f"all of {sorted(want)} to run as one cluster")

    def close(self) -> None:
        try:
            with ThreadPoolExecutor(len(self.nodes)) as pool:
                for stopped in [pool.submit(node.stop, 30) for node in self.nodes]:
                    with contextlib.suppress(InstanceError):
                        stopped.result()
        finally:
            if self._own_dir:
                shutil.rmtree(self.base_dir, ignore_errors=True)

    # --- faults -----------------------------------------------------------------------

    def leader(self, queue: str, vhost: str = "/") -> PrivateRabbit | None:
        """The node leading a quorum queue now (None if the queue is unknown or has none)."""
        info = self.queue(queue, vhost) or {}
        name = info.get("leader") or info.get("node")
        return next((node for node in self.nodes if node.node == name), None)

    def kill_leader(self, queues: list[str], vhost: str = "/") -> PrivateRabbit:
        """``kill -9`` of the node leading most of ``queues``; it stays down until :meth:`bring_back`."""
        leaders = Counter(node for node in (self.leader(q, vhost) for q in queues) if node is not None)
        if not leaders:
            raise InstanceError(f"none of {queues} has a leader to kill")
        node = leaders.most_common(1)[0][0]
        node.kill()
        self.node_kills += 1
        return node

    def lose_leader(self, queues: list[str], vhost: str = "/") -> PrivateRabbit:
        """``kill -9`` of the node leading most of ``queues``, for good: the cluster goes on
        with the others (:meth:`wait_complete` and :meth:`restart` leave it out)."""
        node = self.kill_leader(queues, vhost)
        self.lost.append(node)
        return node

    def bring_back(self, node: PrivateRabbit, timeout: float = 120) -> None:
        """Start a killed node again; it rejoins the cluster from its own data."""
        node.start(timeout)
        self.wait_complete(timeout)

    def restart(self, hard: bool = False) -> None:
        """A rolling restart: each node in turn stops and starts, the others keep serving."""
        for node in self.nodes:
            if node in self.lost:
                continue
            node.restart(hard)
            self.wait_complete()
        self.restarts += 1

    # --- use --------------------------------------------------------------------------

    def amqp_url(self, vhost: str = "/") -> str:
        """Every node's URL, comma-separated: a TXBOX_AMQP_URL for the whole cluster."""
        return ",".join(node.amqp_url(vhost) for node in self.nodes)

    def api(self, method: str, path: str, body: Any = None) -> Any:
        """The management API of the first node that answers."""
        error: Exception = InstanceError("no node of the cluster runs")
        for node in self.nodes:
            if not node.running():
                continue
            try:
                return node.api(method, path, body)
            except (OSError, InstanceError) as exc:
                error = exc
        raise error


def _safe(call: Any) -> Any:
    try:
        return call()
    except (OSError, InstanceError):
        return None
