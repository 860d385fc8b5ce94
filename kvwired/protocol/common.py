"""Message types more than one channel speaks."""

from __future__ import annotations

from typing import Any

from ..errors import KvwireError
from .fields import ERROR, REQ, STR, wire
from .framing import Message, message_type


@message_type("error")
class Error(Message):
    """The sender of this frame ends the connection, and says why."""

    error: dict[str, Any] = wire(ERROR)


@message_type("failed")
class Failed(Message):
    """A request's end, told to its engine: the error, as ``KvwireError.to_wire``."""

    req: str = wire(REQ)
    error: dict[str, Any] = wire(ERROR)


@message_type("hello")
class LocalHello(Message):
    """An engine's first frame on a daemon's unix socket."""

    role: str = wire(STR)


def error_message(error: KvwireError) -> Error:
    return Error(error=error.to_wire())
