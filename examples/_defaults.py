"""Where the example services find their database and contracts when nothing is set.

Only defaults: every ``TXBOX_*`` variable still wins, so the same app runs in the demo,
in the tests (their own databases and vhosts) and in your own set-up.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from framework import JwtSettings
from framework.settings import load

#: The repository's contracts folder, whatever the current directory is.
CONTRACTS_DIR = Path(__file__).resolve().parent.parent / "contracts"
#: TEST/DEMO ONLY: the HMAC secret that signs and verifies the examples' tokens. It is public
#: (committed); a real deployment sets TXBOX_JWT_KEYS or TXBOX_JWT_JWKS, and then this is unused.
DEMO_JWT_SECRET = Path(__file__).resolve().parent / "demo-jwt.secret"
DEMO_JWT_AUDIENCE = "txbox-demo"


def database_url(database: str) -> str:
    """``TXBOX_DATABASE_URL`` if set, else the demo's database on the local PostgreSQL."""
    return os.environ.get("TXBOX_DATABASE_URL") or f"postgresql+psycopg://postgres@127.0.0.1:5432/{database}"


def contracts_dir() -> str:
    return os.environ.get("TXBOX_CONTRACTS_DIR") or str(CONTRACTS_DIR)


def jwt_settings() -> JwtSettings:
    """``TXBOX_JWT_*`` when a key source is set, else the demo's public HS256 secret."""
    environ = dict(os.environ)
    if not environ.get("TXBOX_JWT_KEYS") and not environ.get("TXBOX_JWT_JWKS"):
        environ.update(TXBOX_JWT_KEYS=str(DEMO_JWT_SECRET), TXBOX_JWT_ALGORITHMS="HS256")
        environ.setdefault("TXBOX_JWT_AUDIENCE", DEMO_JWT_AUDIENCE)
    return load(JwtSettings, environ)


def demo_token(*permissions: str, ttl: float = 3600) -> str:
    """A token the example services accept, granting ``permissions`` (signed with the demo secret)."""
    import jwt  # the `jwt` extra

    claims = {"sub": "txbox-demo", "aud": DEMO_JWT_AUDIENCE, "exp": int(time.time() + ttl), "permissions": permissions}
    return jwt.encode(claims, DEMO_JWT_SECRET.read_bytes().strip(), algorithm="HS256")
