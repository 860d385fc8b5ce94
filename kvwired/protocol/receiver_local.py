"""Decode engine <-> receiver daemon, over the receiver's unix socket."""

from __future__ import annotations

from typing import Any

from .common import Error, Failed, LocalHello
from .fields import CHECKSUM, INT, LAYER, NOTE, OPTIONAL_U64, READERS, REQ, STR, wire
from .framing import Channel, Message, message_type


@message_type("welcome")
class Welcome(Message):
    name: str = wire(STR)
    pool_size: int = wire(INT)


@message_type("subscribe")
class Subscribe(Message):
    """``readers``: how many engines read the request (the ranks of a parallel
    decode engine that share one push); it is freed when that many have
    released it. Left out: one."""

    req: str = wire(REQ)
    readers: int | None = wire(READERS, default=None)


@message_type("opened")
class Opened(Message):
    """The request has a slot here, its bytes on the way: the first word of a
    subscription (sent when it opens, or on subscribing to one already open),
    with the prefill engine's note, so a decode engine can refuse a push it
    cannot read before its layers land."""

    req: str = wire(REQ)
    note: dict[str, Any] | None = wire(NOTE, default=None)


@message_type("layer")
class Layer(Message):
    """Where the request lies in the pool (the receiver's slot), on each layer:
    an engine may read a landed layer before the whole request is in."""

    req: str = wire(REQ)
    layer: int = wire(LAYER)
    offset: int | None = wire(OPTIONAL_U64, default=None)
    length: int | None = wire(OPTIONAL_U64, default=None)


@message_type("complete")
class Complete(Message):
    req: str = wire(REQ)
    offset: int = wire(INT)
    length: int = wire(INT)
    layers: int = wire(INT)
    checksum: int = wire(CHECKSUM)


@message_type("release")
class Release(Message):
    req: str = wire(REQ)


@message_type("released")
class Released(Message):
    req: str = wire(REQ)


@message_type("unsubscribe")
class Unsubscribe(Message):
    """Stop holding a request without releasing it: the receiver keeps it for
    another engine, as if nobody had subscribed (unclaimed_ttl)."""

    req: str = wire(REQ)


@message_type("unsubscribed")
class Unsubscribed(Message):
    req: str = wire(REQ)


RECEIVER_LOCAL = Channel(
    "receiver_local", LocalHello, Welcome, Subscribe, Opened, Layer, Complete, Release,
    Released, Unsubscribe, Unsubscribed, Failed, Error)
