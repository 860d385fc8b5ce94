"""Decode engine <-> receiver daemon, over the receiver's unix socket."""

from __future__ import annotations

from .common import Error, Failed, LocalHello
from .fields import CHECKSUM, INT, LAYER, OPTIONAL_U64, READERS, REQ, STR, wire
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
    "receiver_local", LocalHello, Welcome, Subscribe, Layer, Complete, Release, Released,
    Unsubscribe, Unsubscribed, Failed, Error)
