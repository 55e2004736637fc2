"""The worker: runs handlers on inbox rows exactly once, with leases, retries and poison detection."""

from framework.errors import HandlerTimeout
from framework.worker.config import WorkerConfig
from framework.worker.daemon import Worker

__all__ = ["HandlerTimeout", "Worker", "WorkerConfig"]
