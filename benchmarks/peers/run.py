"""txbox's relay and inbox stages beside the same stages of other outbox libraries.

Run from the repository root with the repository's virtualenv (``bash
benchmarks/peers/run.sh``). In a scratch folder (``mktemp -d``) it installs each peer
from its registry (a virtualenv for faststream-outbox from PyPI; ``npm install`` for
pg-transactional-outbox), copies in the peer's bench program (our own code, in this
folder, using the peer's public API), and for each stage and round:

* makes a scratch database and a scratch RabbitMQ vhost (management API), with a
  topic exchange ``bench`` and a queue of the same type as txbox's (quorum by default);
* starts the peer's program, which sets its tables up and fills them its own way, then
  says READY; from GO to the moment the work is done (relay: every message in the queue
  and no row left pending; inbox: every delivery a committed inbox row) it is timed, and
  the CPU of its process (with children) and of the scratch database's backends is
  read as ``txbox bench`` reads it (``txbox_tools.bench.cpu.Saturation``);
* runs ``txbox bench relay --json`` / ``txbox bench receiver --json`` with the same
  message count right after, so both sides see the same machine.

Prints one table (medians over the rounds) and, last, one JSON line. Everything it
makes (folder, databases, vhosts) is removed at the end, and every wait has a deadline.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pika
import psycopg
from psycopg import sql

from txbox_tools.bench.cpu import LOAD_APPLICATION, Saturation

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
EXCHANGE = "bench"
PAYLOAD = {"customer": "bench-customer", "sku": "SKU-1", "quantity": 1}


def options() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--messages", type=int, default=20_000)
    p.add_argument("--rounds", type=int, default=3, help="rounds of every stage (the table shows medians)")
    p.add_argument("--stages", default="relay,inbox")
    p.add_argument("--peers", default="faststream-outbox,pg-transactional-outbox")
    p.add_argument("--queue-type", choices=("quorum", "classic"), default="quorum")
    p.add_argument("--admin-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    p.add_argument("--amqp-host", default="127.0.0.1:5672")
    p.add_argument("--management-url", default="http://127.0.0.1:15672/api")
    p.add_argument("--txbox", default=str(ROOT / ".venv" / "bin" / "txbox"))
    p.add_argument("--stage-timeout", type=float, default=600.0, help="seconds one measured run may take")
    p.add_argument("--faststream-outbox-version", default="0.19.0")
    p.add_argument("--pg-transactional-outbox-version", default="0.5.7")
    # The peers' settings: see benchmarks/peers/README.md for why these are their best here.
    p.add_argument("--fs-max-workers", type=int, default=16)
    p.add_argument("--fs-fetch-batch-size", type=int, default=500)
    p.add_argument("--fs-terminal-flush-batch-size", type=int, default=100)
    p.add_argument("--fs-min-fetch-interval", type=float, default=0.01)
    p.add_argument("--pto-batch-size", type=int, default=50, help="polling batch = messages in progress at once")
    p.add_argument("--pto-pool-size", type=int, default=50, help="handler pool's connections")
    p.add_argument("--pto-polling-interval-ms", type=int, default=10)
    p.add_argument("--pto-lock-ms", type=int, default=5000, help="how long a polled row stays locked (retries wait)")
    p.add_argument("--pto-prefetch", type=int, default=1000)
    p.add_argument("--keep-scratch", action="store_true", help="leave the scratch folder (installed peers)")
    return p.parse_args()


def say(text: str) -> None:
    print(f"[peers] {text}", file=sys.stderr, flush=True)


def run(cmd: list[str], cwd: Path, timeout: float = 600) -> str:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


# --- installing the peers ------------------------------------------------------------


def install_faststream_outbox(scratch: Path, version: str) -> dict[str, Any]:
    venv = scratch / "faststream-outbox"
    run([sys.executable, "-m", "venv", str(venv)], scratch)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    run([*pip, f"faststream-outbox[asyncpg]=={version}", "faststream[rabbit]"], scratch)
    shutil.copy(HERE / "faststream_outbox_relay.py", venv / "relay.py")
    listing = json.loads(run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format=json"], scratch))
    wanted = {"faststream-outbox", "faststream", "sqlalchemy", "asyncpg", "aio-pika"}
    versions = {p["name"].lower(): p["version"] for p in listing if p["name"].lower() in wanted}
    return {"python": str(venv / "bin" / "python"), "program": str(venv / "relay.py"), "versions": versions}


def install_pg_transactional_outbox(scratch: Path, version: str) -> dict[str, Any]:
    folder = scratch / "pg-transactional-outbox"
    folder.mkdir()
    (folder / "package.json").write_text(json.dumps({"name": "txbox-peer-bench", "private": True}))
    run(
        ["npm", "install", "--no-audit", "--no-fund", "--loglevel=error", f"pg-transactional-outbox@{version}", "pg",
         "amqplib"],
        folder,
    )  # fmt: skip
    shutil.copy(HERE / "pg_transactional_outbox.js", folder / "bench.js")
    tree = json.loads(run(["npm", "ls", "--json", "--depth=0"], folder))
    versions = {name: dep["version"] for name, dep in tree.get("dependencies", {}).items()}
    versions["node"] = run(["node", "--version"], folder).strip()
    return {"program": str(folder / "bench.js"), "cwd": str(folder), "versions": versions}


# --- scratch database and vhost ------------------------------------------------------


class Scratch:
    """A database and a vhost (exchange ``bench``, one queue) of one measured run; dropped on exit."""

    def __init__(self, args: argparse.Namespace, label: str, queue: str) -> None:
        token = uuid.uuid4().hex[:8]
        self.database = f"txbox_peers_{label}_{token}"
        self.vhost = f"txbox-peers-{label}-{token}"
        self.queue = queue
        self.args = args
        parts = urllib.parse.urlsplit(args.admin_url)
        self.database_url = urllib.parse.urlunsplit((parts.scheme, parts.netloc, f"/{self.database}", "", ""))
        self.amqp_url = f"amqp://guest:guest@{args.amqp_host}/{urllib.parse.quote(self.vhost, safe='')}"

    def _api(self, method: str, path: str, body: Any = None) -> None:
        request = urllib.request.Request(
            self.args.management_url.rstrip("/") + path,
            data=json.dumps(body).encode() if body is not None else None,
            method=method,
        )
        request.add_header("Authorization", "Basic " + base64.b64encode(b"guest:guest").decode())
        request.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(request, timeout=30):
            pass

    def __enter__(self) -> Scratch:
        with psycopg.connect(self.args.admin_url, autocommit=True) as admin:
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.database)))
        vhost = urllib.parse.quote(self.vhost, safe="")
        self._api("PUT", f"/vhosts/{vhost}", {})
        self._api("PUT", f"/permissions/{vhost}/guest", {"configure": ".*", "write": ".*", "read": ".*"})
        connection = pika.BlockingConnection(pika.URLParameters(self.amqp_url))
        try:
            channel = connection.channel()
            channel.exchange_declare(EXCHANGE, "topic", durable=True)
            channel.queue_declare(self.queue, durable=True, arguments={"x-queue-type": self.args.queue_type})
            channel.queue_bind(self.queue, EXCHANGE, routing_key=self.queue)
        finally:
            connection.close()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._api("DELETE", f"/vhosts/{urllib.parse.quote(self.vhost, safe='')}")
        finally:
            with psycopg.connect(self.args.admin_url, autocommit=True) as admin:
                admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(self.database)))


class Watch:
    """The harness's own view of a run: queue depth and SQL counts. Its database
    connection is named like txbox's load generator, so the CPU meter leaves it out."""

    def __init__(self, scratch: Scratch) -> None:
        self.scratch = scratch
        self.amqp = pika.BlockingConnection(pika.URLParameters(scratch.amqp_url))
        self.channel = self.amqp.channel()
        self.db: psycopg.Connection[Any] | None = None

    def depth(self) -> int:
        return int(self.channel.queue_declare(self.scratch.queue, passive=True).method.message_count)

    def count(self, query: str) -> int:
        if self.db is None:
            self.db = psycopg.connect(self.scratch.database_url, autocommit=True, application_name=LOAD_APPLICATION)
        row = self.db.execute(query).fetchone()
        return int(row[0]) if row else 0

    def until(self, done: Callable[[], bool], deadline: float, what: Callable[[], str], every: float) -> None:
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"not done by the deadline: {what()}")
            self.amqp.sleep(every)

    def close(self) -> None:
        if self.db is not None:
            self.db.close()
        self.amqp.close()


# --- one measured peer run -----------------------------------------------------------


class Program:
    """A peer's bench program in its own process group, talking READY / GO / STOP."""

    def __init__(self, cmd: list[str], cwd: str, log: Path) -> None:
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            cmd, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
            start_new_session=True,
        )  # fmt: skip
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for text in self.proc.stdout:
            if text.strip() == "READY":
                self.ready.set()
            else:  # what the program logs on its standard output goes to its log too
                self.log.write(text)
                self.log.flush()

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the peer program did not get ready (exit {self.proc.poll()}); see {self.log.name}")

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        try:
            if self.alive():
                self.send("STOP")
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            self.proc.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.log.close()


def measure_peer(
    args: argparse.Namespace,
    scratch: Scratch,
    cmd: list[str],
    cwd: str,
    log: Path,
    done: Callable[[Watch], bool],
    progress: Callable[[Watch], str],
) -> dict[str, Any]:
    program = Program(cmd, cwd, log)
    watch = Watch(scratch)
    try:
        program.wait_ready(timeout=args.stage_timeout)
        cpu = Saturation(scratch.database_url)
        cpu.start([program.proc.pid])
        started = time.perf_counter()
        program.send("GO")
        deadline = time.monotonic() + args.stage_timeout

        def finished() -> bool:
            if not program.alive():
                raise RuntimeError(f"the peer program exited ({program.proc.returncode}); see {log}")
            return done(watch)

        watch.until(finished, deadline, lambda: progress(watch), every=0.01)
        seconds = time.perf_counter() - started
        cpu.stop()  # while the peer's backends are still connected
        result = {"seconds": round(seconds, 3), "rate": round(args.messages / seconds, 1)}
        result.update(cpu.per_message(args.messages))
        result["in_queue"] = watch.depth()
        return result
    finally:
        watch.close()
        program.stop()


def faststream_relay(args: argparse.Namespace, peer: dict[str, Any], scratch_dir: Path) -> dict[str, Any]:
    with Scratch(args, "fs_relay", "bench.relay") as scratch:
        parts = urllib.parse.urlsplit(scratch.database_url)
        config = {
            "database_url": urllib.parse.urlunsplit(("postgresql+asyncpg", parts.netloc, parts.path, "", "")),
            "amqp_url": scratch.amqp_url,
            "exchange": EXCHANGE,
            "routing_key": scratch.queue,
            "messages": args.messages,
            "body": envelope(0),
            "max_workers": args.fs_max_workers,
            "fetch_batch_size": args.fs_fetch_batch_size,
            "min_fetch_interval": args.fs_min_fetch_interval,
            "max_fetch_interval": 1.0,
            "terminal_flush_batch_size": args.fs_terminal_flush_batch_size,
        }
        n = args.messages
        result = measure_peer(
            args,
            scratch,
            [peer["python"], peer["program"], json.dumps(config)],
            str(scratch_dir),
            scratch_dir / "faststream-outbox-relay.log",
            done=lambda w: w.depth() >= n and w.count("SELECT count(*) FROM outbox") == 0,
            progress=lambda w: f"{w.depth()} in the queue, {w.count('SELECT count(*) FROM outbox')} rows left",
        )
        result["message_bytes"] = len(json.dumps(config["body"]).encode())
        result["config"] = {k: config[k] for k in ("max_workers", "fetch_batch_size", "terminal_flush_batch_size",
                                                    "min_fetch_interval")}  # fmt: skip
        return result


def pto_config(args: argparse.Namespace, scratch: Scratch, mode: str) -> dict[str, Any]:
    return {
        "mode": mode,
        "database_url": scratch.database_url,
        "database": scratch.database,
        "amqp_url": scratch.amqp_url,
        "exchange": EXCHANGE,
        "routing_key": scratch.queue,
        "queue": scratch.queue,
        "messages": args.messages,
        "payload": PAYLOAD,
        "batch_size": args.pto_batch_size,
        "pool_size": args.pto_pool_size,
        "polling_interval_ms": args.pto_polling_interval_ms,
        "lock_ms": args.pto_lock_ms,
        "prefetch": args.pto_prefetch,
    }


def pto_relay(args: argparse.Namespace, peer: dict[str, Any], scratch_dir: Path) -> dict[str, Any]:
    with Scratch(args, "pto_relay", "bench.relay") as scratch:
        config = pto_config(args, scratch, "relay")
        n = args.messages
        pending = "SELECT count(*) FROM outbox WHERE processed_at IS NULL"
        result = measure_peer(
            args,
            scratch,
            ["node", peer["program"], json.dumps(config)],
            peer["cwd"],
            scratch_dir / "pg-transactional-outbox-relay.log",
            done=lambda w: w.depth() >= n and w.count(pending) == 0,
            progress=lambda w: f"{w.depth()} in the queue, {w.count(pending)} rows left",
        )
        result["config"] = {k: config[k] for k in ("batch_size", "pool_size", "polling_interval_ms", "lock_ms")}
        result["config"]["listener"] = "polling"
        return result


def pto_inbox(args: argparse.Namespace, peer: dict[str, Any], scratch_dir: Path) -> dict[str, Any]:
    with Scratch(args, "pto_inbox", "bench.inbox") as scratch:
        bodies = [json.dumps(transactional_message(i)).encode() for i in range(args.messages)]
        fill_queue(scratch, bodies)
        config = pto_config(args, scratch, "inbox")
        n = args.messages
        result = measure_peer(
            args,
            scratch,
            ["node", peer["program"], json.dumps(config)],
            peer["cwd"],
            scratch_dir / "pg-transactional-outbox-inbox.log",
            done=lambda w: w.count("SELECT count(*) FROM inbox") >= n,
            progress=lambda w: f"{w.count('SELECT count(*) FROM inbox')} inbox rows, {w.depth()} in the queue",
        )
        result["message_bytes"] = len(bodies[0])
        result["config"] = {k: config[k] for k in ("prefetch", "pool_size")}
        return result


def envelope(i: int) -> dict[str, Any]:
    """A body of about the size of txbox's PlaceOrder envelope."""
    return {
        "message_id": str(uuid.uuid4()),
        "message_type": "PlaceOrder",
        "aggregate_type": "order",
        "aggregate_id": f"bench-{i}",
        "message_version": "1.0",
        "payload": PAYLOAD,
        "message_context": {"correlation_id": str(uuid.uuid4())},
        "created_at": datetime.now(UTC).isoformat(),
    }


def transactional_message(i: int) -> dict[str, Any]:
    """A delivery as a pg-transactional-outbox relay sends it (its TransactionalMessage)."""
    return {
        "id": str(uuid.uuid4()),
        "aggregateType": "order",
        "aggregateId": str(i),
        "messageType": "PlaceOrder",
        "segment": f"order:{i}",
        "concurrency": "parallel",
        "payload": {"customer": f"customer-{i % 977}", "sku": f"SKU-{i % 113}", "quantity": 1 + i % 9},
        "metadata": {"correlation_id": str(uuid.uuid4())},
        "createdAt": datetime.now(UTC).isoformat(),
    }


def fill_queue(scratch: Scratch, bodies: list[bytes]) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(scratch.amqp_url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        props = pika.BasicProperties(content_type="application/json", delivery_mode=2)
        for body in bodies:
            channel.basic_publish(EXCHANGE, scratch.queue, body, props)
    finally:
        connection.close()


# --- txbox's own stages --------------------------------------------------------------


def txbox_stage(args: argparse.Namespace, stage: str) -> dict[str, Any]:
    bench = {"relay": "relay", "inbox": "receiver"}[stage]
    cmd = [args.txbox, "bench", bench, "--json", "--messages", str(args.messages), "--queue-type", args.queue_type]
    out = run(cmd, ROOT, timeout=args.stage_timeout * 3)
    data: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    keep = ("rate", "seconds", "cpu_ms_per_message", "raw_limit_rate", "ratio", "raw_cpu_ms_per_message")
    return {k: data[k] for k in keep if k in data} | {
        "message_bytes": data.get("message_bytes", data.get("body_bytes"))
    }


# --- the table -----------------------------------------------------------------------

PEER_STAGES: dict[tuple[str, str], Callable[[argparse.Namespace, dict[str, Any], Path], dict[str, Any]]] = {
    ("relay", "faststream-outbox"): faststream_relay,
    ("relay", "pg-transactional-outbox"): pto_relay,
    ("inbox", "pg-transactional-outbox"): pto_inbox,
}
CANNOT = {("inbox", "faststream-outbox"): "no inbox: the package only sends (consumers' idempotency is yours)"}


def median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return round(statistics.median(values), 3) if values else None


def table(
    results: dict[str, dict[str, list[dict[str, Any]]]], stages: list[str], peers: list[str]
) -> list[dict[str, Any]]:
    rows = []
    for stage in stages:
        mine = results[stage].get("txbox", [])
        t_rate, t_cpu = median(mine, "rate"), median(mine, "cpu_ms_per_message")
        rows.append({"stage": stage, "peer": "txbox", "rate": t_rate, "cpu_ms_per_message": t_cpu, "runs": len(mine)})
        for peer in peers:
            if (stage, peer) in CANNOT:
                rows.append({"stage": stage, "peer": peer, "note": CANNOT[(stage, peer)]})
                continue
            runs = results[stage].get(peer, [])
            rate, cpu = median(runs, "rate"), median(runs, "cpu_ms_per_message")
            rows.append({
                "stage": stage, "peer": peer, "rate": rate, "cpu_ms_per_message": cpu, "runs": len(runs),
                "txbox_over_peer_rate": round(t_rate / rate, 2) if t_rate and rate else None,
                "peer_over_txbox_cpu": round(cpu / t_cpu, 2) if cpu and t_cpu else None,
                "rates": [r.get("rate") for r in runs],
            })  # fmt: skip
    return rows


def show(rows: list[dict[str, Any]]) -> None:
    print(f"{'stage':<7} {'peer':<24} {'msg/s':>9} {'CPU ms/msg':>11} {'txbox/peer':>11} {'peer CPU/txbox':>15}")
    for r in rows:
        if "note" in r:
            print(f"{r['stage']:<7} {r['peer']:<24} {'—':>9} {'—':>11} {'—':>11} {'—':>15}  {r['note']}")
            continue

        def cell(v: Any, w: int) -> str:
            return f"{v:>{w},}" if isinstance(v, (int, float)) else f"{'?':>{w}}"

        ratio = (
            f"{r['txbox_over_peer_rate']}x" if r.get("txbox_over_peer_rate") else ("" if r["peer"] == "txbox" else "?")
        )
        cpu = f"{r['peer_over_txbox_cpu']}x" if r.get("peer_over_txbox_cpu") else ("" if r["peer"] == "txbox" else "?")
        print(f"{r['stage']:<7} {r['peer']:<24} {cell(r['rate'], 9)} {cell(r['cpu_ms_per_message'], 11)} "
              f"{ratio:>11} {cpu:>15}")  # fmt: skip


def main() -> None:
    args = options()
    # The session's ceiling (run.sh) sends SIGTERM: unwind, so every scratch is dropped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    stages = [s for s in args.stages.split(",") if s]
    peers = [p for p in args.peers.split(",") if p]
    if not Path(args.txbox).exists():
        raise SystemExit(f"{args.txbox} not found: run `make setup` first")
    scratch_dir = Path(tempfile.mkdtemp(prefix="txbox-peers-"))
    say(f"scratch folder {scratch_dir}")
    installed: dict[str, dict[str, Any]] = {}
    results: dict[str, dict[str, list[dict[str, Any]]]] = {s: {} for s in stages}
    load = [os.getloadavg()[0]]
    started = datetime.now(UTC)
    try:
        for peer in peers:
            say(f"installing {peer}")
            if peer == "faststream-outbox":
                installed[peer] = install_faststream_outbox(scratch_dir, args.faststream_outbox_version)
            elif peer == "pg-transactional-outbox":
                installed[peer] = install_pg_transactional_outbox(scratch_dir, args.pg_transactional_outbox_version)
            else:
                raise SystemExit(f"unknown peer {peer}")
        for round_ in range(1, args.rounds + 1):
            for stage in stages:
                # Interleaved: each peer, then txbox, on the same machine minutes.
                for peer in peers:
                    measure = PEER_STAGES.get((stage, peer))
                    if measure is None:
                        continue
                    say(f"round {round_}: {stage} · {peer}")
                    try:
                        outcome = measure(args, installed[peer], scratch_dir)
                    except (RuntimeError, TimeoutError) as exc:
                        say(f"  failed: {exc}")
                        outcome = {"error": str(exc)}
                    outcome["load"] = os.getloadavg()[0]
                    say(f"  {outcome}")
                    results[stage].setdefault(peer, []).append(outcome)
                say(f"round {round_}: {stage} · txbox")
                mine = txbox_stage(args, stage) | {"load": os.getloadavg()[0]}
                say(f"  {mine}")
                results[stage].setdefault("txbox", []).append(mine)
                load.append(os.getloadavg()[0])
    finally:
        if args.keep_scratch:
            say(f"left {scratch_dir}")
        else:
            shutil.rmtree(scratch_dir, ignore_errors=True)
    rows = table(results, stages, peers)
    show(rows)
    print(json.dumps({
        "date": started.isoformat(timespec="seconds"),
        "messages": args.messages,
        "rounds": args.rounds,
        "queue_type": args.queue_type,
        "load_1min": [round(x, 2) for x in load],
        "peers": {p: i["versions"] for p, i in installed.items()},
        "table": rows,
        "runs": results,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
