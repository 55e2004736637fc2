"""Importing txbox changes no driver globals; a daemon's start tunes them, once.

Each check runs in a fresh interpreter: this test process may have started daemons already.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_GLOBALS = """
import gc, pika.data, psycopg._queries
def driver_globals():
    return (pika.data.decode_value, psycopg._queries.MAX_CACHED_STATEMENT_PARAMS,
            psycopg._queries.MAX_CACHED_STATEMENT_LENGTH, gc.get_freeze_count() > 0, gc.get_threshold())
before = driver_globals()
"""


def _run(code: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _GLOBALS + code], check=False, cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def test_importing_framework_and_its_daemons_changes_neither_pika_nor_psycopg() -> None:
    _run(
        "import framework, framework.amqp, framework.db, framework.outbox, framework.confirms, framework.relay,"
        " framework.receiver, framework.worker, framework.dead_letters.collector, framework.cli.run\n"
        "assert driver_globals() == before, (driver_globals(), before)\n"
    )


def test_a_daemon_tunes_the_drivers_when_it_is_built_and_tuning_again_changes_nothing() -> None:
    _run(
        "from framework import Service, drivers\n"
        "from framework.dead_letters.collector import Collector\n"
        "from tests.apps.counter import CONTRACTS\n"
        "service = Service(name='counter-service', database_url='postgresql://x@127.0.0.1/x',"
        " amqp_url='amqp://guest:guest@127.0.0.1:5672/%2F', contracts_dir=CONTRACTS)\n"
        "Collector(service)\n"
        "tuned = driver_globals()\n"
        "assert tuned[0] is not before[0] and tuned[0].bounded\n"
        "assert tuned[1] >= 1 << 16 and tuned[2] >= 1 << 20\n"
        "assert tuned[3], 'the heap built before the first message is frozen for the garbage collector'\n"
        "assert tuned[4] == (drivers.YOUNG_THRESHOLD, *before[4][1:]), (tuned[4], before[4])\n"
        "drivers.tune_drivers()\n"
        "assert driver_globals() == tuned\n"
    )


def test_a_daemon_keeps_the_collector_thresholds_an_application_chose() -> None:
    _run(
        "gc.set_threshold(5000, 20, 20)\n"
        "from framework import drivers\n"
        "drivers.tune_drivers()\n"
        "assert gc.get_threshold() == (5000, 20, 20), gc.get_threshold()\n"
    )
