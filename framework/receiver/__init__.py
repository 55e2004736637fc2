"""The receiver: `<service>:inbox` → txbox.inbox, exactly once per message id."""

from framework.receiver.config import ReceiverConfig
from framework.receiver.daemon import Receiver
from framework.receiver.intake import Delivery, Intake

__all__ = ["Delivery", "Intake", "Receiver", "ReceiverConfig"]
