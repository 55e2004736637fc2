"""Where the example services find their database and contracts when nothing is set.

Only defaults: every ``TXBOX_*`` variable still wins, so the same app runs in the demo,
in the tests (their own databases and vhosts) and in your own set-up.
"""

from __future__ import annotations

import os
from pathlib import Path

#: The repository's contracts folder, whatever the current directory is.
CONTRACTS_DIR = Path(__file__).resolve().parent.parent / "contracts"


def database_url(database: str) -> str:
    """``TXBOX_DATABASE_URL`` if set, else the demo's database on the local PostgreSQL."""
    return os.environ.get("TXBOX_DATABASE_URL") or f"postgresql+psycopg://postgres@127.0.0.1:5432/{database}"


def contracts_dir() -> str:
    return os.environ.get("TXBOX_CONTRACTS_DIR") or str(CONTRACTS_DIR)
