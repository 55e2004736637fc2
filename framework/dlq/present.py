"""How a dead letter is shown to people: secrets masked (DESIGN §2: auth_token is carried,
never logged, and shown masked), shared by the terminal and the dashboard."""

from __future__ import annotations

from typing import Any

SECRET_KEYS = frozenset({"auth_token", "authorization", "password", "x-auth-token"})


def mask(value: Any) -> str:
    """A secret as its kind and length only: enough to tell 'present' from 'empty'."""
    if not isinstance(value, str) or value == "":
        return "" if value == "" else "•••• (masked)"
    return f"•••• (masked, {len(value)} chars)"


def masked(value: Any) -> Any:
    """A copy of ``value`` with every secret-looking key's value masked, at any depth."""
    if isinstance(value, dict):
        return {k: mask(v) if str(k).lower() in SECRET_KEYS and v is not None else masked(v) for k, v in value.items()}
    if isinstance(value, list):
        return [masked(v) for v in value]
    return value
