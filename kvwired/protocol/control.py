"""Sender daemon <-> receiver daemon, over TCP (TLS when ``auth = "tls"``)."""

from __future__ import annotations

from typing import Any

from .common import Error
from .fields import (
    CHANNEL,
    CHECKSUM,
    CREDITS,
    DATA_CHANNEL,
    DICT,
    ERROR,
    FLAG,
    INT,
    KEY,
    KEYS,
    LEASE,
    LEASE_KEYS,
    LIST,
    NAMES,
    NOTE,
    OPTIONAL_CHECKSUM,
    OPTIONAL_ERROR,
    OUTCOME,
    PORT,
    REQ,
    SHAPE,
    STR,
    wire,
)
from .framing import Channel, Message, message_type


@message_type("hello")
class Hello(Message):
    role: str = wire(STR)
    name: str = wire(STR)
    transports: list[str] = wire(NAMES)


@message_type("welcome")
class Welcome(Message):
    name: str = wire(STR)
    transport: str = wire(STR)
    credits: int = wire(CREDITS)


@message_type("connect")
class Connect(Message):
    """One data channel: in the handshake, then once per further channel
    (qps_per_peer), each answered by its ``ready``."""

    params: dict[str, Any] = wire(DICT)


@message_type("ready")
class Ready(Message):
    params: dict[str, Any] = wire(DICT)


@message_type("replace")
class Replace(Message):
    """A data channel that failed under a live control connection, replaced in place."""

    req: str = wire(REQ)
    channel: int = wire(DATA_CHANNEL)
    params: dict[str, Any] = wire(DICT)


@message_type("replaced")
class Replaced(Message):
    """The receiver's new responder for the channel, and new keys for the
    leases that still take writes, as [lease, key] pairs (the old keys died
    with the old responder)."""

    req: str = wire(REQ)
    params: dict[str, Any] = wire(DICT)
    keys: list[list[int]] = wire(LEASE_KEYS)


@message_type("open")
class Open(Message):
    req: str = wire(REQ)
    shape: dict[str, int] = wire(SHAPE)
    discard: int | None = wire(FLAG, default=None)  # 1: an experiment's, freed once delivered
    note: dict[str, Any] | None = wire(NOTE, default=None)  # for the decode engine


@message_type("lease")
class Lease(Message):
    """``keys``: the remote keys for this lease's bytes alone, one per data
    channel the session had when it was granted, live while it fills."""

    req: str = wire(REQ)
    lease: int = wire(LEASE)
    offset: int = wire(INT)
    keys: list[int] = wire(KEYS)


@message_type("refused")
class Refused(Message):
    req: str = wire(REQ)
    error: dict[str, Any] = wire(ERROR)


@message_type("abort")
class Abort(Message):
    req: str = wire(REQ)
    lease: int = wire(LEASE)
    error: dict[str, Any] = wire(ERROR)


@message_type("abort_ack")
class AbortAck(Message):
    req: str = wire(REQ)
    lease: int = wire(LEASE)


@message_type("delivered")
class Delivered(Message):
    req: str = wire(REQ)
    lease: int = wire(LEASE)
    checksum: int = wire(CHECKSUM)


@message_type("withdrawn")
class Withdrawn(Message):
    """A request the sender gave up before asking for a lease (its staging
    full, its deadline): the receiver tells the decode engines waiting for it."""

    req: str = wire(REQ)
    error: dict[str, Any] = wire(ERROR)


@message_type("ask")
class Ask(Message):
    """A sender that lost its connection after posting a lease's last layer
    asks how it ended (kvwired.verdicts)."""

    req: str = wire(REQ)
    lease: int = wire(LEASE)


@message_type("verdict")
class Verdict(Message):
    """How a lease ended: "unknown" for one the receiver never held or forgot."""

    req: str = wire(REQ)
    lease: int = wire(LEASE)
    outcome: str = wire(OUTCOME)
    checksum: int | None = wire(OPTIONAL_CHECKSUM, default=None)
    error: dict[str, Any] | None = wire(OPTIONAL_ERROR, default=None)


@message_type("credits")
class Credits(Message):
    """Credits of one data channel's receives (the first one's when absent)."""

    n: int = wire(CREDITS)
    channel: int | None = wire(CHANNEL, default=None)


@message_type("echo_open")
class EchoOpen(Message):
    """Echo mode (kvctl run chunk-sweep): the receiver leases a slot and opens
    a data channel back to the sender; an immediate naming the echo lease is
    answered by a write of the same size (sizes[layer bits]) with the same
    immediate."""

    req: str = wire(REQ)
    bytes: int = wire(INT)
    sizes: list[int] = wire(LIST)


@message_type("echo_offer")
class EchoOffer(Message):
    req: str = wire(REQ)
    lease: int = wire(LEASE)
    offset: int = wire(INT)
    key: int = wire(KEY)
    params: dict[str, Any] = wire(DICT)


@message_type("echo_answer")
class EchoAnswer(Message):
    req: str = wire(REQ)
    lease: int = wire(LEASE)
    reply_offset: int = wire(INT)
    params: dict[str, Any] = wire(DICT)


@message_type("echo_ready")
class EchoReady(Message):
    req: str = wire(REQ)
    lease: int = wire(LEASE)


@message_type("echo_close")
class EchoClose(Message):
    """``answers``: echo answers the sender has seen, each a credit back."""

    req: str = wire(REQ)
    lease: int = wire(LEASE)
    answers: int = wire(INT)


@message_type("baseline")
class Baseline(Message):
    """The perftest baseline: the receiver runs the tool's server side."""

    req: str = wire(REQ)
    tool: str = wire(STR)
    size: int = wire(INT)
    iters: int = wire(INT)


@message_type("baseline_ready")
class BaselineReady(Message):
    req: str = wire(REQ)
    port: int = wire(PORT)


@message_type("baseline_stop")
class BaselineStop(Message):
    req: str = wire(REQ)


@message_type("ping")
class Ping(Message):
    pass


@message_type("pong")
class Pong(Message):
    pass


@message_type("bye")
class Bye(Message):
    """A clean goodbye: the daemon is shutting down (or the peer was removed)."""

    reason: str = wire(STR)


CONTROL = Channel(
    "control", Hello, Welcome, Connect, Ready, Replace, Replaced, Open, Lease, Refused,
    Abort, AbortAck, Delivered, Withdrawn, Ask, Verdict, Credits, EchoOpen, EchoOffer,
    EchoAnswer, EchoReady, EchoClose, Baseline, BaselineReady, BaselineStop, Ping, Pong,
    Bye, Error)

# What a receiver sends in answer to a sender's request (matched by ``req``).
ANSWERS: tuple[type[Message], ...] = (Lease, Refused, Verdict, Replaced, EchoOffer,
                                      EchoReady, BaselineReady)
