"""What engines import: ``SenderClient`` (prefill) and ``ReceiverClient`` (decode).

Both map their daemon's pool: the prefill engine writes each layer straight
into registered staging memory and commits it (the daemon sends that layer
while the engine computes the next); the decode engine reads delivered KV in
place and releases it. ``SyncSenderClient`` and ``SyncReceiverClient`` wrap
them for callers without an event loop.

Its parts, bottom to top: ``results`` (what the clients hand back),
``connection`` (a local daemon connection, what both clients share),
``push`` (``OutgoingPush``), ``recovery`` (asking a restarted sender daemon
how fully committed pushes ended), ``sender``, ``receiver``, and ``sync``
(``LoopThread`` and the synchronous wrappers). Everything a user needs is
imported from here.
"""

from .connection import (
    DEFAULT_RECEIVER_SOCKET,
    DEFAULT_SENDER_SOCKET,
    RECEIVER_SOCKET_VARIABLE,
    SENDER_SOCKET_VARIABLE,
)
from .push import DAEMON_RETURN_WAIT, VERDICT_GRACE, OutgoingPush
from .receiver import ReceiverClient
from .results import Delivered, LayerLanded, PushOpened, PushResult
from .sender import SenderClient
from .sync import LoopThread, SyncPush, SyncReceiverClient, SyncSenderClient

__all__ = [
    "DAEMON_RETURN_WAIT", "DEFAULT_RECEIVER_SOCKET", "DEFAULT_SENDER_SOCKET",
    "RECEIVER_SOCKET_VARIABLE", "SENDER_SOCKET_VARIABLE", "VERDICT_GRACE", "Delivered",
    "LayerLanded", "LoopThread", "OutgoingPush", "PushOpened", "PushResult",
    "ReceiverClient", "SenderClient", "SyncPush", "SyncReceiverClient", "SyncSenderClient",
]
