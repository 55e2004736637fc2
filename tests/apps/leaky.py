"""An application whose own code fails quoting its configured URL: the masked-traceback tests.

At import it starts a thread of its own (a connection pool's, say) that dies of an
exception quoting ``TXBOX_DATABASE_URL``, an AMQP ``?password=`` URL and a libpq DSN
with the same password, and waits for it. With ``LEAKY_FAIL_AT_IMPORT=1`` the import
itself then fails the same way, uncaught in the main thread. Neither failure is a
TxboxError: no handler of txbox formats them, Python's hooks print them.

Run: ``txbox check --app tests.apps.leaky:service`` with ``TXBOX_DATABASE_URL`` set.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from urllib.parse import urlsplit

from framework import Service
from framework.settings import Settings

CONTRACTS = Path(__file__).resolve().parents[2] / "contracts"

URL = os.environ["TXBOX_DATABASE_URL"]
PASSWORD = urlsplit(URL).password or ""
QUOTED = f"cannot reach {URL} nor amqp://mq/%2F?password={PASSWORD} (dsn: host=db password={PASSWORD})"


def _pool() -> None:
    raise ConnectionError(QUOTED)


_thread = threading.Thread(target=_pool, name="leaky pool", daemon=True)
_thread.start()
_thread.join()
if os.environ.get("LEAKY_FAIL_AT_IMPORT"):
    raise RuntimeError(QUOTED)

service = Service(settings=Settings.from_env(None, service="order-service", contracts_dir=CONTRACTS))
