"""The worker: runs handlers on inbox rows exactly once, with leases, retries and poison detection."""

from framework.worker.config import WorkerConfig
from framework.worker.daemon import Worker
from framework.worker.timeout import HandlerTimeout

__all__ = ["HandlerTimeout", "Worker", "WorkerConfig"]
