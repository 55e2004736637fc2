"""Fingerprints group failures: one bug → one group, two bugs → two groups."""

from __future__ import annotations

import random
import re
import subprocess
import sys
import uuid
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from framework.dead_letters import fingerprint, normalize_error


def _rand_id(rng: random.Random) -> str:
    """An id like `K7QX2M9A`: letters and digits. (An all-letter word is indistinguishable
    from prose, so it is only masked when quoted.)"""
    chars = [rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ23456789") for _ in range(7)]
    return "".join(chars) + rng.choice("23456789")


# Realistic error texts, each a template of one bug with the parts that vary per message.
BUGS = {
    "unique": (
        "psycopg.errors.UniqueViolation",
        lambda r: (
            'duplicate key value violates unique constraint "orders_pkey"\n'
            f"DETAIL:  Key (id)=({r.randint(1, 10**9)}) already exists."
        ),
    ),
    "keyerror": ("KeyError", lambda r: f"'customer-{r.randint(1, 99999)}'"),
    "timeout": (
        "TimeoutError",
        lambda r: (
            f"handler exceeded its timeout of {r.randint(5, 60)}.{r.randint(0, 9)}s "
            f"for message {uuid.uuid4()} at {r.randint(2020, 2030)}-0{r.randint(1, 9)}-1{r.randint(0, 9)}T"
            f"1{r.randint(0, 9)}:3{r.randint(0, 9)}:0{r.randint(0, 9)}.{r.randint(100, 999)}Z"
        ),
    ),
    "http": (
        "requests.exceptions.HTTPError",
        lambda r: (
            f"404 Client Error: Not Found for url: http://inventory:8080/items/{r.randint(1, 10**6)}"
            f"?sku=SKU-{r.randint(1000, 9999)}"
        ),
    ),
    "object": (
        "AttributeError",
        lambda r: f"'NoneType' object has no attribute 'price' (<Order object at 0x{r.getrandbits(48):012x}>)",
    ),
    "stock": (
        "InsufficientStock",
        lambda r: f"only {r.randint(0, 9)} of {_rand_id(r)} left, wanted {r.randint(10, 99)}",
    ),
    "email": (
        "ValueError",
        lambda r: f"customer user{r.randint(1, 10**5)}@example.com is blocked (order_{r.randint(1, 999)})",
    ),
    "hash": ("LookupError", lambda r: f"no price list for catalog rev {r.getrandbits(64):016x}"),
}


def test_ten_thousand_failures_from_one_bug_are_one_group() -> None:
    rng = random.Random(7)
    for name, (error_type, make) in BUGS.items():
        prints = {fingerprint("PlaceOrder", error_type, make(rng)) for _ in range(10_000 if name == "unique" else 500)}
        assert len(prints) == 1, (name, [normalize_error(make(rng)) for _ in range(3)])


def test_different_bugs_are_different_groups() -> None:
    rng = random.Random(1)
    prints = {fingerprint("PlaceOrder", t, make(rng)) for t, make in BUGS.values()}
    assert len(prints) == len(BUGS)


def test_message_type_and_exception_type_split_groups() -> None:
    text = "'customer'"
    assert fingerprint("PlaceOrder", "KeyError", text) != fingerprint("RestockItem", "KeyError", text)
    assert fingerprint("PlaceOrder", "KeyError", text) != fingerprint("PlaceOrder", "IndexError", text)
    assert fingerprint(None, "not_json", "x") == fingerprint(None, "not_json", "x")


def test_postgres_object_names_are_kept() -> None:
    a = 'duplicate key value violates unique constraint "orders_pkey"'
    b = 'duplicate key value violates unique constraint "orders_customer_key"'
    assert fingerprint("PlaceOrder", "UniqueViolation", a) != fingerprint("PlaceOrder", "UniqueViolation", b)
    assert 'relation "stock"' in normalize_error('relation "stock" does not exist')


def test_normalized_text_reads_well() -> None:
    text = f"order {uuid.uuid4()} failed at 2024-03-02T08:56:22.555Z after 3 tries: 'ORD-7F3K2Q'"
    assert normalize_error(text) == "order <uuid> failed at <ts> after <n> tries: <str>"
    assert normalize_error("a\n\n  b\tc") == "a b c"


def test_long_texts_are_bounded() -> None:
    assert len(normalize_error("x" * 10_000)) == 500


@given(st.text(max_size=300), st.integers(), st.integers())
def test_numbers_never_split_a_group(prefix: str, a: int, b: int) -> None:
    prefix = "".join(c for c in prefix if not c.isalnum() and c not in "'\"=()@.-+_")
    assert fingerprint("T", "E", f"{prefix} value {a} !") == fingerprint("T", "E", f"{prefix} value {b} !")


def test_a_long_number_is_a_number_not_a_uuid() -> None:
    assert normalize_error(f"value {10**31} !") == "value <n> !"
    assert normalize_error(f"id {uuid.uuid4().hex} and {uuid.uuid4()}") == "id <uuid> and <uuid>"


# Inputs crafted against the patterns: a word boundary at every character, runs that almost
# match, and the classic shapes of catastrophic backtracking for each pattern.
ADVERSARIAL = {
    "dotted words (e-mail local part)": "a." * (1 << 19),
    "dashed letters (mixed id)": "a-" * (1 << 19),
    "dashed digits (mixed id)": "1-" * (1 << 19),
    "e-mails without a domain": "a.a@" * (1 << 18),
    "domain labels without an end": "a@" + "a-." * (1 << 18),
    "almost hex": ("a" * 100 + "g ") * 10_000,
    "digits": "1" * (1 << 20),
    "0x": "0x" * (1 << 19),
    "quotes": "'a" * (1 << 19),
    "open quote": '"' + "a" * (1 << 20),
    "key values": "=(" * (1 << 19),
    "timestamps": "2020-01-01T" * 95_000,
    "uuid-ish": ("1" * 31 + " ") * 32_768,
    "pg names": 'constraint "' * 87_000,
    "numbers": "1." * (1 << 19),
    "exponents": "1e" * (1 << 19),
    "whitespace": " \t" * (1 << 19),
}

# Each pattern against the inputs crafted for it (names as in framework.dead_letters).
TARGETS = {
    "_EMAIL": ["dotted words (e-mail local part)", "e-mails without a domain", "domain labels without an end"],
    "_MIXED_ID": ["dashed letters (mixed id)", "dashed digits (mixed id)", "almost hex"],
    "_UUID": ["uuid-ish", "digits", "almost hex"],
    "_HEX": ["almost hex", "0x", "digits"],
    "_TIMESTAMP": ["timestamps", "digits"],
    "_QUOTED": ["quotes", "open quote"],
    "_KEY_VALUE": ["key values"],
    "_PG_NAME": ["pg names"],
    "_NUMBER": ["numbers", "exponents", "digits"],
    "_SPACE": ["whitespace"],
}

_JUDGE = """
import sys
from framework import dead_letters
from tests.unit.test_fingerprint import ADVERSARIAL, TARGETS
if sys.argv[1] == "patterns":  # each pattern on its own, without the scan limit: shows it is linear
    for name, cases in TARGETS.items():
        for case in cases:
            getattr(dead_letters, name).sub("", ADVERSARIAL[case][: 256 * 1024])
            print(name, case, flush=True)
else:
    for case, text in ADVERSARIAL.items():
        print(case, dead_letters.fingerprint("T", "E", text), len(dead_letters.normalize_error(text)), flush=True)
"""


def _judge(what: str) -> list[str]:
    # A subprocess, so a hang fails at the guard (naming the last input done), never hangs the suite.
    try:
        done = subprocess.run(
            [sys.executable, "-c", _JUDGE, what],
            cwd=Path(__file__).parents[2],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"hung after: {exc.stdout!r}") from None
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_judging_1_mib_adversarial_errors_completes() -> None:
    lines = _judge("errors")
    assert len(lines) == len(ADVERSARIAL)
    for line in lines:
        *_, fp, length = line.split()
        assert len(fp) == 16 and int(length) <= 500


def test_every_pattern_is_linear() -> None:
    """256 KiB each: a quadratic pattern needs ~10^10 steps here (minutes), a linear one well under a second."""
    assert len(_judge("patterns")) == sum(map(len, TARGETS.values()))


def test_every_pattern_has_adversarial_inputs() -> None:
    from framework import dead_letters

    patterns = {n for n, v in vars(dead_letters).items() if isinstance(v, re.Pattern)}
    assert patterns == set(TARGETS)


def test_sender_text_cannot_forge_the_internal_marker() -> None:
    text = 'constraint "a" and \x00PGNAME\x00 twice \x00PGNAME\x00'
    assert normalize_error(text).startswith('constraint "a" and')


def test_lone_surrogates_and_nul_are_fingerprinted() -> None:
    assert len(fingerprint("T\ud800", "E\x00", "bad \udfff text \x00")) == 16
