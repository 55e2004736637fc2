"""Smoke runs of `txbox bench e2e`, `latency`, `receiver` and `worker`: a few hundred messages each.

Not a measurement (timings never decide a test): they prove the benchmarks still run end
to end through the real daemons and print the documented JSON line.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
from pathlib import Path
from typing import Any

import psutil
import psycopg
import pytest

from tests import support
from tests.conftest import ROOT
from txbox_tools.processes import txbox_command

COMMON = ("--admin-url", support.PG_ADMIN_URL, "--workers", "1")


def bench(*args: str, common: tuple[str, ...] = COMMON) -> dict[str, object]:
    done = subprocess.run(
        [*txbox_command(), "bench", *args, "--json", *common],
        cwd=ROOT, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.slow
def test_bench_e2e_smoke() -> None:
    """``--tracing``'s two pairs of runs (untraced and traced, A B B A), with their CPU by part."""
    small = ("--pings", "150", "--window", "100", "--batch", "50", "--raw-messages", "300")
    result = bench("e2e", *small, "--tracing", "--pairs", "2")
    ratios = result["tracing_ratios"]
    assert isinstance(ratios, list) and len(ratios) == 2 and all(r > 0 for r in ratios), ratios
    assert result["tracing_ratio"] == pytest.approx(sum(ratios) / 2, abs=0.002)
    assert result["stage"] == "e2e"
    assert result["messages"] == 300  # every Ping and its Pong handled
    for key in ("seconds", "rate", "raw_limit_rate", "ratio", "raw_limit", "untraced_rate", "tracing_ratio"):
        assert result[key], key
    parts = {"publisher", "receiver", "worker-1", "postgres", "rabbitmq", "total"}
    traced, untraced = result["cpu_us_per_message"], result["untraced_cpu_us_per_message"]
    assert isinstance(traced, dict) and isinstance(untraced, dict)
    for spent in (traced, untraced):
        assert set(spent) == parts, spent
        # Each daemon and its backends worked for every message; the meter saw it.
        assert all(spent[part] > 0 for part in ("publisher", "receiver", "worker-1", "postgres")), spent
        assert spent["total"] == pytest.approx(sum(v for k, v in spent.items() if k != "total"), abs=1)
    more = result["tracing_cpu_us_per_message"]
    assert isinstance(more, dict) and set(more) == parts
    assert more["total"] == pytest.approx(traced["total"] - untraced["total"], abs=0.2)


@pytest.mark.slow
def test_bench_e2e_signing_smoke() -> None:
    """``--signing``: a pair of runs, the second signing every Pong and verifying it in the receiver.

    Every message handled means the receiver accepted every signature the publisher made:
    one it refused would be dead-lettered and the run would stall and fail.
    """
    small = ("--pings", "150", "--window", "100", "--batch", "50", "--raw-messages", "300")
    result = bench("e2e", *small, "--signing", "--pairs", "1")
    assert result["messages"] == 300
    assert isinstance(result["signing_ratios"], list) and len(result["signing_ratios"]) == 1
    assert result["signed_events"] == [150]  # every Pong of the signed run came signed
    for key in ("unsigned_rate", "signing_ratio", "unsigned_cpu_us_per_message", "signing_cpu_us_per_message"):
        assert result[key], key


@pytest.mark.slow
def test_bench_latency_smoke() -> None:
    result = bench("latency", "--rate", "50", "--seconds", "3", "--raw-seconds", "1", "--warmup", "0")
    assert result["stage"] == "latency"
    assert result["messages"] == 150
    for key in ("p50_ms", "p99_ms", "raw_p50_ms", "raw_limit_rate", "ratio", "cpu_ratio", "p50_ratio", "p99_ratio"):
        assert isinstance(result[key], float | int), key
    assert result["handler"] == "statement"  # one INSERT per message, as the raw path's consumer
    assert float(result["p50_ms"]) <= float(result["p99_ms"])  # type: ignore[arg-type]
    # CPU: every component of the pipeline spent some (a process missed, or read after it
    # exited, would show 0); the raw path's second is too short for a clock tick in each.
    for prefix, components in (("", {"publisher", "receiver", "worker-1", "postgres", "rabbitmq"}),
                               ("raw_", {"consumer", "postgres", "rabbitmq"})):  # fmt: skip
        parts = result[f"{prefix}cpu_cores_by_component"]
        assert isinstance(parts, dict) and set(parts) == components
        assert all(value > 0 for value in parts.values()) or prefix, parts
        assert float(result[f"{prefix}cpu_cores"]) == pytest.approx(sum(parts.values()), abs=0.01)  # type: ignore[arg-type]
        assert float(result[f"{prefix}cpu_ms_per_message"]) > 0  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["receiver", "worker"])
def test_bench_stage_with_two_instances(stage: str) -> None:
    """Two daemon processes share the work, and the bench counts all of it (instances.timed)."""
    floor = ("--floor",) if stage == "receiver" else ()
    common = ("--admin-url", support.PG_ADMIN_URL)
    result = bench(stage, "--messages", "3000", "--instances", "2", *floor, common=common)
    assert result["stage"] == stage
    assert result["messages"] == 3000 and result["instances"] == 2
    for key in ("seconds", "rate", "raw_limit_rate", "ratio", *(("floor_rate", "floor_ratio") if floor else ())):
        assert float(result[key]) > 0, key  # type: ignore[arg-type]


@pytest.mark.slow
def test_bench_worker_and_e2e_history_smoke() -> None:
    """`--history N` measures again over N finished rows per table and reports the ratio."""
    worker = bench("worker", "--messages", "500", "--instances", "1", "--history", "1000", common=COMMON[:2])
    e2e = bench(
        "e2e", "--pings", "100", "--window", "100", "--batch", "50", "--raw-messages", "200", "--history", "1000"
    )
    for result, tables in ((worker, ["inbox"]), (e2e, ["outbox", "inbox"])):
        history: Any = result["history"]
        assert history["rows"] == 1000 and history["rate"] > 0 and history["ratio"] > 0
        assert [f["table"] for f in history["filled"]] == tables
        assert all(f["rows"] == 1000 and f["abandoned"] == 20 for f in history["filled"])


@pytest.mark.slow
def test_bench_soak_smoke(tmp_path: Path) -> None:
    """A soak of seconds with retention of seconds: the daemons prune while it samples."""
    result = bench(
        "soak", "--duration", "12s", "--rate", "40", "--retention", "3s", "--prune-interval", "1s",
        "--sample", "2s", "--out", str(tmp_path),
    )  # fmt: skip
    assert result["stage"] == "soak" and result["messages"] == 480
    written = json.loads((tmp_path / "soak.json").read_text())
    samples = written["samples"]
    assert len(samples) >= 4 and all({"rate", "p99_ms", "outbox", "inbox"} <= set(s) for s in samples)
    # Everything older than 3 s goes within a second or so: never all 480 rows at once.
    assert max(s["outbox"]["rows"] for s in samples) < 480 and max(s["inbox"]["rows"] for s in samples) < 480
    assert (tmp_path / "soak.svg").read_text().startswith("<svg")


def _scratch_services() -> tuple[set[str], set[str]]:
    """The e2e benches' scratch databases and vhosts that exist now."""
    with psycopg.connect(support.PG_ADMIN_URL, autocommit=True) as conn:
        rows = conn.execute("SELECT datname FROM pg_database WHERE datname LIKE 'txbox_bench_e2e_%'").fetchall()
    vhosts = {v["name"] for v in support.mgmt("GET", "/vhosts") if v["name"].startswith("txbox-bench-e2e-")}
    return {r[0] for r in rows}, vhosts


@pytest.mark.slow
def test_a_killed_bench_stops_its_daemons_and_drops_its_scratch_service(tmp_path: Path) -> None:
    """SIGTERM (a CI timeout, ``kill``) unwinds the bench like Ctrl-C, so nothing of it is left behind."""
    before = _scratch_services()
    log = tmp_path / "bench.log"
    with log.open("wb") as out:
        bench_process = subprocess.Popen(
            [*txbox_command(), "bench", "e2e", "--pings", "1000000", "--raw-messages", "200", *COMMON],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        process = psutil.Process(bench_process.pid)

        def started() -> list[psutil.Process]:
            """The bench's daemon processes once all three run: publisher, receiver, worker-1."""
            found = []
            for child in process.children():
                with contextlib.suppress(psutil.Error):
                    if "--app" in child.cmdline():
                        found.append(child)
            return found if len(found) == 3 else []

        daemons = support.wait_until(started, 120, message="the bench's daemons")
        # Its own: another bench on the machine may make (and drop) scratch services meanwhile.
        databases, vhosts = _scratch_services()
        ours = (databases - before[0], vhosts - before[1])
        assert all(ours), ours
        bench_process.send_signal(signal.SIGTERM)
        # Its daemons get 20 s to stop (ProcessGroup.stop_all), then the scratch database
        # and vhost are dropped: on a machine busy with the other test process (a Spark or
        # RabbitMQ cluster starting) one CI run took more than 60 s in all.
        try:
            bench_process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the bench did not end within 120 s of SIGTERM:\n{log.read_text(errors='replace')[-3000:]}")
    finally:
        if bench_process.poll() is None:
            bench_process.kill()
    _, alive = psutil.wait_procs(daemons, timeout=30)
    assert not alive, [p.cmdline() for p in alive]
    databases, vhosts = _scratch_services()
    assert not (ours[0] & databases or ours[1] & vhosts), "the scratch database and vhost were dropped"
