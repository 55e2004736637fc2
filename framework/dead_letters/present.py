"""How a dead letter is shown to people, shared by the terminal and the dashboard.

Secrets are masked through :mod:`framework.redaction` (the one list of sensitive keys);
text meant for a terminal has its control characters escaped, so a message cannot
rewrite the operator's screen (ANSI escapes), hide lines (carriage return) or reorder
what is read (bidirectional overrides).
"""

from __future__ import annotations

import re

from framework.redaction import mask, masked

__all__ = ["mask", "masked", "printable"]

# C0 controls but newline and tab, DEL, C1 controls, bidi embeddings/overrides/isolates,
# line/paragraph separators: one character each, so the substitution is linear.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\u200e\u200f\u061c]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group(0))
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str) -> str:
    """``text`` safe for a terminal: control characters shown as ``\\xNN`` / ``\\uNNNN``."""
    return _CONTROL.sub(_escape, text)
