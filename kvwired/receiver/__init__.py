"""The receiver daemon (decode node), as a package of its parts (see daemon.py)."""

from .daemon import ReceiverDaemon, ReceiverService
from .senders import MAX_PEER_LABELS
from .session import SenderSession

__all__ = ["MAX_PEER_LABELS", "ReceiverDaemon", "ReceiverService", "SenderSession"]
