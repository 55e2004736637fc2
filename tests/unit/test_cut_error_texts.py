"""Error texts cut to a length before they are stored never keep a cut URL's password.

A cut inside ``scheme://user:password@`` loses the ``@`` that tells the masking a
password is there (framework/redaction.py, ``clip``); the relay's unbuildable rows and the
worker's undecodable values cut their texts, and both end up in dead letters.
"""

from __future__ import annotations

from framework.redaction import mask_credentials
from framework.relay.messages import unbuildable
from framework.worker.decode import _undecodable
from tests.unit.test_publisher import claimed

SECRET = "hunter2-never-shown"


def _straddling(at: int, prefix: str = "") -> str:
    """A text whose URL's password is cut ``at`` characters into the text (after ``prefix``)."""
    url = f"postgresql://app:{SECRET}@db.internal/orders"
    head = "x" * (at - len(prefix) - len("postgresql://app:") - 4)
    return head + url


def test_an_unbuildable_rows_error_cut_through_a_url_keeps_no_password() -> None:
    prefix = "the relay could not build its message: ValueError: "
    _, error = unbuildable(claimed(), ValueError(_straddling(2000, prefix)))
    text = mask_credentials(str(error))
    assert len(str(error)) <= 2000
    assert SECRET[:4] not in text


def test_an_undecodable_values_text_and_error_cut_through_a_url_keep_no_password() -> None:
    value = _straddling(100_000).encode()
    letter = _undecodable(value, ValueError(_straddling(500, "ValueError: ")))
    assert SECRET[:4] not in mask_credentials(letter.text)
    assert SECRET[:4] not in mask_credentials(letter.error)
