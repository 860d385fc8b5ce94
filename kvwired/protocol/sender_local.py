"""Prefill engine <-> sender daemon, over the sender's unix socket."""

from __future__ import annotations

from typing import Any

from .common import Error, Failed, LocalHello
from .fields import (
    CHECKSUM,
    CHUNK_BYTES,
    DICT,
    FLAG,
    INT,
    LAYER,
    LEASE,
    NOTE,
    OPTIONAL_LIST,
    REQ,
    SECONDS,
    SHAPE,
    STR,
    wire,
)
from .framing import Channel, Message, message_type


@message_type("welcome")
class Welcome(Message):
    name: str = wire(STR)
    pool_size: int = wire(INT)
    peers: list[Any] | None = wire(OPTIONAL_LIST, default=None)


@message_type("open")
class Open(Message):
    req: str = wire(REQ)
    peer: str = wire(STR)
    shape: dict[str, int] = wire(SHAPE)
    chunk_bytes: int | None = wire(CHUNK_BYTES, default=None)
    deadline: float | None = wire(SECONDS, default=None)
    discard: int | None = wire(FLAG, default=None)
    # For the decode engine (its receiver passes it on); opaque to the daemons.
    note: dict[str, Any] | None = wire(NOTE, default=None)


@message_type("opened")
class Opened(Message):
    """``peer``: the receiver the push goes to (the one chosen, for "auto");
    ``lease``: the receiver's lease, by which an engine can ask later."""

    req: str = wire(REQ)
    peer: str = wire(STR)
    offset: int = wire(INT)
    chunk_bytes: int = wire(INT)
    lease: int = wire(LEASE)


@message_type("commit")
class Commit(Message):
    req: str = wire(REQ)
    layer: int = wire(LAYER)


@message_type("sent")
class Sent(Message):
    """Layers up to ``layer`` are placed in the receiver's memory: their
    staging may be reused."""

    req: str = wire(REQ)
    layer: int = wire(LAYER)


@message_type("finished")
class Finished(Message):
    req: str = wire(REQ)
    checksum: int = wire(CHECKSUM)
    timings: dict[str, float] = wire(DICT)


@message_type("abort")
class Abort(Message):
    req: str = wire(REQ)


@message_type("ask")
class Ask(Message):
    """An engine whose daemon went away after it committed every layer asks
    the restarted daemon how the request ended: ``finished`` or ``failed``."""

    req: str = wire(REQ)
    peer: str = wire(STR)
    lease: int = wire(LEASE)


@message_type("dropped")
class Dropped(Message):
    """After finished/failed: the engine holds no view of the request's
    staging any more, so the daemon may reuse it."""

    req: str = wire(REQ)


@message_type("run")
class Run(Message):
    """An experiment run by the daemon (kvctl run): progress, one row per
    finished measurement, then the result or ``failed``."""

    req: str = wire(REQ)
    experiment: str = wire(STR)
    params: dict[str, Any] = wire(DICT)


@message_type("progress")
class Progress(Message):
    req: str = wire(REQ)
    phase: str = wire(STR)
    done: int = wire(INT)
    total: int = wire(INT)


@message_type("row")
class Row(Message):
    req: str = wire(REQ)
    row: dict[str, Any] = wire(DICT)


@message_type("result")
class Result(Message):
    req: str = wire(REQ)
    result: dict[str, Any] = wire(DICT)


SENDER_LOCAL = Channel(
    "sender_local", LocalHello, Welcome, Open, Opened, Commit, Sent, Finished, Abort, Ask,
    Failed, Dropped, Run, Progress, Row, Result, Error)
