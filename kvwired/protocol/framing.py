"""Frames and message types: bytes in, typed messages out, and back.

A frame is a 4-byte big-endian length followed by one msgpack map. Every
map has ``t`` (its type) and ``v`` (the protocol version). Each channel is a
set of message classes (frozen dataclasses, one per type); a frame is
checked against its channel's field specs on receipt and becomes an
instance of its class, so the code behind this module only ever sees
well-formed, typed messages; anything else becomes a ``ProtocolError`` that
the connection answers with an ``error`` frame and closes.

Nothing here does I/O. ``FrameDecoder`` takes bytes as they arrive
(``feed``) and hands out messages (``next_message``), the way h11's
``receive_data``/``next_event`` do; ``encode`` makes the bytes to send. The
one adapter to asyncio streams is ``kvwired.stream``; the blocking handshake
of the client library feeds the same decoder.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar, Generic, TypeVar, cast, dataclass_transform

import msgpack

from ..errors import FrameTooLarge, InvalidRequest, ProtocolError, VersionMismatch
from .fields import REQ, Field, wire

PROTOCOL_VERSION = 6
# An engine's ``peer`` that lets the sender choose (discovery: the connected
# receiver with the most free pool). No receiver may be named so.
AUTO_PEER = "auto"
MAX_FRAME = 1 << 20
_LENGTH = struct.Struct(">I")

# A frame's map as it is on the wire: what tests and adversaries build.
RawMessage = dict[str, Any]


class Message:
    """A message of one of the channels; each type is a frozen dataclass."""

    __slots__ = ()
    kind: ClassVar[str]

    def to_wire(self) -> RawMessage:
        raw: RawMessage = {"t": self.kind, "v": PROTOCOL_VERSION}
        for name in _field_names(type(self)):
            value = getattr(self, name)
            if value is not None:  # an optional field left out is absent on the wire
                raw[name] = value
        return raw


M = TypeVar("M", bound=Message)


@dataclass_transform(frozen_default=True, kw_only_default=True, field_specifiers=(wire,))
def message_type(kind: str) -> Callable[[type[M]], type[M]]:
    """Make a class the message type ``kind``: a frozen, keyword-only dataclass."""
    def make(cls: type[M]) -> type[M]:
        cls.kind = kind
        made = dataclasses.dataclass(frozen=True, slots=True, kw_only=True)(cls)
        for item in dataclasses.fields(cast(Any, made)):
            spec = item.metadata.get("spec")
            assert isinstance(spec, Field), f"{kind}.{item.name} needs wire(SPEC)"
            assert spec.required == (item.default is dataclasses.MISSING), \
                f"{kind}.{item.name}: an optional field says default=None, a required one not"
        return made
    return make


_FIELD_NAMES: dict[type[Message], tuple[str, ...]] = {}


def _field_names(cls: type[Message]) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(item.name for item in dataclasses.fields(cast(Any, cls)))
    return names


def _specs(cls: type[Message]) -> dict[str, Field]:
    return {item.name: item.metadata["spec"] for item in dataclasses.fields(cast(Any, cls))}


class Channel(Mapping[str, Mapping[str, Field]]):
    """One channel's vocabulary: its message types, and each one's field specs
    (the mapping: type name -> field -> spec)."""

    def __init__(self, name: str, *types: type[Message]) -> None:
        self.name = name
        self.types: dict[str, type[Message]] = {}
        for cls in types:
            assert cls.kind not in self.types, f"{name}: two types named {cls.kind!r}"
            self.types[cls.kind] = cls
        self._schema = {kind: _specs(cls) for kind, cls in self.types.items()}

    def __getitem__(self, kind: str) -> Mapping[str, Field]:
        return self._schema[kind]

    def __iter__(self) -> Iterator[str]:
        return iter(self._schema)

    def __len__(self) -> int:
        return len(self._schema)

    def make(self, raw: RawMessage) -> Message:
        """The typed message of a map already validated against this channel."""
        cls = self.types[raw["t"]]
        return cls(**{name: raw.get(name) for name in _field_names(cls)})


def message(kind: str, **fields: Any) -> RawMessage:
    """A raw frame's map: for tests and for what no channel's types allow."""
    return {"t": kind, "v": PROTOCOL_VERSION, **fields}


def encode(msg: Message | RawMessage) -> bytes:
    raw = msg.to_wire() if isinstance(msg, Message) else msg
    body: bytes = msgpack.packb(raw, use_bin_type=True)
    if len(body) > MAX_FRAME:
        raise FrameTooLarge(f"refusing to send a {len(body)} B frame (limit {MAX_FRAME} B)")
    return _LENGTH.pack(len(body)) + body


def decode(body: bytes, channel: Channel) -> Message:
    """Unpack, validate and type one frame body of ``channel``."""
    try:
        raw = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"frame is not valid msgpack: {exc}") from exc
    return validate(raw, channel)


def validate(raw: object, channel: Channel) -> Message:
    if not isinstance(raw, dict):
        raise ProtocolError(f"frame is a {type(raw).__name__}, not a map")
    version = raw.get("v")
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(
            f"peer speaks kvwire protocol version {version!r}, this side speaks "
            f"{PROTOCOL_VERSION}",
            hint="run the same kvwire release on both ends",
        )
    kind = raw.get("t")
    if not isinstance(kind, str) or kind not in channel:
        raise ProtocolError(
            f"unknown message type {kind!r}",
            hint=f"expected one of {', '.join(sorted(channel))}",
        )
    fields = channel[kind]
    try:
        _check_fields(kind, raw, fields)
    except ProtocolError as exc:
        req = raw.get("req")
        if "req" in fields and isinstance(req, str) and REQ.check is not None \
                and REQ.check(req) is None:
            # The frame is whole and names its request: only that request is bad.
            raise InvalidRequest(exc.message, hint=exc.hint, req=req) from None
        raise
    return channel.make(raw)


def _check_fields(kind: str, raw: dict[str, Any], fields: Mapping[str, Field]) -> None:
    for name, field in fields.items():
        if name not in raw or raw[name] is None:
            if field.required:
                raise ProtocolError(f"{kind!r} message lacks field {name!r}")
            continue
        value = raw[name]
        # bool is an int in Python; no field of ours is a bool.
        if isinstance(value, bool) or not isinstance(value, field.types):
            wanted = " or ".join(t.__name__ for t in field.types)
            raise ProtocolError(
                f"{kind!r} field {name!r} is {type(value).__name__}, expected {wanted}",
                hint=f"send {field.expected}" if field.expected else "",
            )
        if field.check is not None and (wrong := field.check(value)) is not None:
            raise ProtocolError(f"{kind!r} field {name!r}: {wrong}",
                                hint=f"send {field.expected}" if field.expected else "")


class FrameDecoder:
    """Bytes in, typed messages out; one per channel direction.

    ``next_message`` returns None until a whole frame is buffered. A frame
    announced larger than ``max_frame`` is refused from its header alone,
    so a peer cannot make us buffer it.
    """

    def __init__(self, channel: Channel, max_frame: int = MAX_FRAME) -> None:
        self.channel = channel
        self.max_frame = max_frame
        self._buffer = bytearray()
        self._start = 0

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if self._start and self._start * 2 > len(self._buffer):
            # Drop what was consumed once it is the larger part.
            del self._buffer[: self._start]
            self._start = 0
        self._buffer += data

    @property
    def buffered(self) -> int:
        """Bytes received and not yet handed out as a message."""
        return len(self._buffer) - self._start

    def next_message(self) -> Message | None:
        if self.buffered < _LENGTH.size:
            return None
        (length,) = _LENGTH.unpack_from(self._buffer, self._start)
        if length > self.max_frame:
            raise FrameTooLarge(
                f"peer announced a {length} B frame; the limit is {self.max_frame} B",
                hint="the peer is not a kvwire daemon of this version, or is broken",
            )
        end = self._start + _LENGTH.size + length
        if len(self._buffer) < end:
            return None
        body = bytes(self._buffer[self._start + _LENGTH.size : end])
        self._start = end
        return decode(body, self.channel)

    def end_of_stream(self) -> None:
        """The peer closed: fine between frames, a ProtocolError inside one."""
        if self.buffered == 0:
            return
        if self.buffered < _LENGTH.size:
            raise ProtocolError("stream ended inside a frame header")
        (length,) = _LENGTH.unpack_from(self._buffer, self._start)
        raise ProtocolError(
            f"stream ended inside a frame ({self.buffered - _LENGTH.size} of {length} B)")


C = TypeVar("C")


class Handlers(Generic[C]):
    """Dispatch by message type: ``on(Open, handler)``, then ``handlers(ctx, msg)``.

    mypy checks each handler against the type it is registered for, so every
    field a handler reads is checked; a type nobody registered is the peer
    breaking the protocol (``who`` says whom, in the error).
    """

    def __init__(self, who: str) -> None:
        self.who = who
        self._table: dict[type[Message], Callable[[C, Any], object]] = {}

    def on(self, kind: type[M], handler: Callable[[C, M], object]) -> None:
        self._table[kind] = handler

    def __contains__(self, kind: type[Message]) -> bool:
        return kind in self._table

    def __call__(self, context: C, msg: Message) -> object:
        handler = self._table.get(type(msg))
        if handler is None:
            raise ProtocolError(f"{self.who} may not send {msg.kind!r}")
        return handler(context, msg)
