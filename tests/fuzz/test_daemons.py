"""The real `txbox receiver` and `txbox collector` under generated hostile traffic.

Hypothesis generates batches of deliveries (see tests/fuzz/cases.py): valid PlaceOrder
messages, duplicates of them (same content, or the same id with other content), and
hostile ones — random bytes, bent envelopes, NUL and control characters, deep JSON,
oversized bodies, odd AMQP properties and header tables (deep, wide, large, wrong-typed
``x-txbox-*``, malformed ``x-death``) — published with plain pika to the ``command``
exchange, straight to the inbox queue, to the ``retry`` exchange and to the
``dead_letter`` exchange, interleaved. After each batch the verdict comes from the
database: every valid message stored once, every hostile one dead-lettered once with its
body, duplicates quiet or ``id_conflict``, both daemons alive, both queues drained.

The run does not stop at the first bad batch: a broken round restarts the daemons and
the run goes on, so one run reports every failure class it meets, grouped.

Budget: ``TXBOX_FUZZ_EXAMPLES`` batches (default 8) of at most ``TXBOX_FUZZ_BATCH``
deliveries (default 20), derandomized unless ``TXBOX_FUZZ_SEED`` is set; `make fuzz
SEED=… EXAMPLES=…` runs a longer one.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, example, given, seed, settings

from framework.service import Service
from tests.fuzz.cases import Case, batches, landmarks
from tests.fuzz.harness import Finding, Fuzzer

pytestmark = [pytest.mark.acceptance, pytest.mark.slow]

EXAMPLES = int(os.environ.get("TXBOX_FUZZ_EXAMPLES", "8"))
BATCH = int(os.environ.get("TXBOX_FUZZ_BATCH", "20"))
SEED = os.environ.get("TXBOX_FUZZ_SEED")
ROUND_TIMEOUT = float(os.environ.get("TXBOX_FUZZ_ROUND_TIMEOUT", "15"))


@pytest.fixture
def fuzzer(service: Service, database_url: str, amqp_url: str, vhost: str, tmp_path: Path) -> Iterator[Fuzzer]:
    logs = Path(os.environ.get("TXBOX_FUZZ_LOG_DIR") or tmp_path / "logs")
    for stale in [*logs.glob("*.log"), logs / "findings.txt"]:  # a kept directory holds one run only
        stale.unlink(missing_ok=True)
    fuzz = Fuzzer(service, database_url, amqp_url, vhost, logs, ROUND_TIMEOUT)
    fuzz.start()
    try:
        yield fuzz
    finally:
        fuzz.group.stop_all(timeout=10)


def _report(findings: list[Finding], fuzz: Fuzzer, rounds: int) -> str:
    classes = Counter((f.daemon, f.symptom) for f in findings)
    lines = [f"{len(findings)} findings in {rounds} batches ({fuzz.published} deliveries, {fuzz.refused} refused):"]
    for (daemon, symptom), count in classes.most_common():
        example = next(f for f in findings if (f.daemon, f.symptom) == (daemon, symptom))
        lines.append(f"  {count:4d} x [{daemon}] {symptom}")
        if example.case:
            lines.append(f"         e.g. {example.case}")
    return "\n".join(lines)


def test_receiver_and_collector_survive_generated_traffic(fuzzer: Fuzzer) -> None:
    findings: list[Finding] = []
    rounds = 0

    @settings(
        max_examples=EXAMPLES,
        derandomize=SEED is None,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],  # a round's failure is reported, not shrunk: the daemons carry state
        suppress_health_check=list(HealthCheck),
    )
    @given(batch=batches(BATCH))
    def one_round(batch: list[Case]) -> None:
        nonlocal rounds
        rounds += 1
        findings.extend(fuzzer.round(batch))

    known = landmarks()
    for batch in reversed(known):  # explicit examples run before the generated ones
        one_round = example(batch=batch)(one_round)
    if SEED is not None:
        one_round = seed(int(SEED))(one_round)
    one_round()
    assert rounds == EXAMPLES + len(known) and fuzzer.published > 0, "the run published nothing"

    codes = fuzzer.stop()  # both must also stop cleanly on SIGTERM after all that
    findings += [Finding(name, f"exit code {code} on SIGTERM (want 0)") for name, code in codes.items() if code != 0]
    if findings:  # every finding with its case, beside the daemons' logs
        (fuzzer.log_dir / "findings.txt").write_text("\n".join(map(str, findings)) + "\n")
    assert not findings, (
        _report(findings, fuzzer, rounds) + f"\n(all findings: {fuzzer.log_dir}/findings.txt)\n" + fuzzer.logs()
    )


def test_batches_cover_every_expectation_and_route() -> None:
    """The generator itself: over a few batches it produces every kind of case on every route."""
    seen: set[tuple[str, str]] = set()

    # 75, not 25: in one full run, 25 drew no `either` case, though derandomized and passing
    # alone (the cause is not known); with three times the examples a miss is far less likely.
    @settings(max_examples=75, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(batch=batches(BATCH))
    def collect(batch: list[Case]) -> None:
        seen.update((c.expect, c.route) for c in batch)

    collect()
    expects = {e for e, _ in seen}
    routes = {r for _, r in seen}
    assert expects >= {"valid", "dup_same", "dup_conflict", "hostile", "either", "collected"}, expects
    assert routes == {"command", "inbox", "retry", "dead_letter"}, routes
