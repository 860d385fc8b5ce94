"""Messages of the control connection and of the local unix APIs.

``framing``: frames, typed messages, the I/O-free ``FrameDecoder`` and
dispatch by type (``Handlers``); ``fields``: what each field may hold;
``control``, ``sender_local`` and ``receiver_local``: each channel's message
types, one frozen dataclass each; ``common``: the types several channels share.
"""

from .common import Error, Failed, LocalHello, error_message
from .control import CONTROL
from .fields import MAX_LAYER_BYTES, MAX_SECONDS, VERDICTS, Field
from .framing import (
    AUTO_PEER,
    MAX_FRAME,
    PROTOCOL_VERSION,
    Channel,
    FrameDecoder,
    Handlers,
    Message,
    RawMessage,
    decode,
    encode,
    message,
    validate,
)
from .receiver_local import RECEIVER_LOCAL
from .sender_local import SENDER_LOCAL

__all__ = [
    "AUTO_PEER", "CONTROL", "MAX_FRAME", "MAX_LAYER_BYTES", "MAX_SECONDS", "PROTOCOL_VERSION",
    "RECEIVER_LOCAL", "SENDER_LOCAL", "VERDICTS", "Channel", "Error", "Failed", "Field",
    "FrameDecoder", "Handlers", "LocalHello", "Message", "RawMessage", "decode", "encode",
    "error_message", "message", "validate",
]
