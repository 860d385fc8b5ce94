"""Messages of the control connection and of the local unix APIs.

A frame is a 4-byte big-endian length followed by one msgpack map. Every
map has ``t`` (its type) and ``v`` (the protocol version). Frames are
checked against the schema of their channel on receipt, so the code behind
this module only ever sees well-formed messages; anything else becomes a
``ProtocolError`` that the connection answers with an ``error`` frame and
closes.

Nothing here does I/O. ``FrameDecoder`` takes bytes as they arrive
(``feed``) and hands out validated messages (``next_message``), the way h11's
``receive_data``/``next_event`` do; ``encode`` makes the bytes to send. The
one adapter to asyncio streams is ``kvwired.stream``; the blocking handshake
of the client library feeds the same decoder.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from .errors import FrameTooLarge, KvwireError, ProtocolError, VersionMismatch

PROTOCOL_VERSION = 1
MAX_FRAME = 1 << 20
_LENGTH = struct.Struct(">I")

Message = dict[str, Any]


@dataclass(frozen=True)
class Field:
    types: tuple[type, ...]
    required: bool = True


def _f(*types: type, required: bool = True) -> Field:
    return Field(types, required)


INT = _f(int)
STR = _f(str)
DICT = _f(dict)
ERROR = _f(dict)

Schema = Mapping[str, Mapping[str, Field]]

# Sender daemon <-> receiver daemon, over TCP.
CONTROL: Schema = {
    "hello": {"role": STR, "name": STR, "transports": _f(list)},
    "welcome": {"name": STR, "transport": STR, "credits": INT},
    "connect": {"params": DICT},
    "ready": {"params": DICT},
    # discard=1: an experiment's request, freed as soon as it is delivered.
    "open": {"req": STR, "shape": DICT, "discard": _f(int, required=False)},
    "lease": {"req": STR, "lease": INT, "offset": INT},
    "refused": {"req": STR, "error": ERROR},
    "abort": {"req": STR, "lease": INT, "error": ERROR},
    "abort_ack": {"req": STR, "lease": INT},
    "delivered": {"req": STR, "lease": INT, "checksum": INT},
    "credits": {"n": INT},
    # Echo mode (kvctl run chunk-sweep): the receiver leases a slot and opens a
    # data channel back to the sender; an immediate naming the echo lease is
    # answered by a write of the same size (sizes[layer bits]) with the same
    # immediate.
    "echo_open": {"req": STR, "bytes": INT, "sizes": _f(list)},
    "echo_offer": {"req": STR, "lease": INT, "offset": INT, "params": DICT},
    "echo_answer": {"req": STR, "lease": INT, "reply_offset": INT, "params": DICT},
    "echo_ready": {"req": STR, "lease": INT},
    "echo_close": {"req": STR, "lease": INT},
    # The perftest baseline: the receiver runs the tool's server side.
    "baseline": {"req": STR, "tool": STR, "size": INT, "iters": INT},
    "baseline_ready": {"req": STR, "port": INT},
    "baseline_stop": {"req": STR},
    "ping": {},
    "pong": {},
    # A clean goodbye: the daemon is shutting down (or the peer was removed).
    "bye": {"reason": STR},
    "error": {"error": ERROR},
}

# What a receiver sends in answer to a sender's request (matched by ``req``).
CONTROL_ANSWERS = frozenset({"lease", "refused", "echo_offer", "echo_ready", "baseline_ready"})

# Prefill engine <-> sender daemon, over the sender's unix socket.
SENDER_LOCAL: Schema = {
    "hello": {"role": STR},
    "welcome": {"name": STR, "pool_size": INT, "peers": _f(list, required=False)},
    "open": {
        "req": STR,
        "peer": STR,
        "shape": DICT,
        "chunk_bytes": _f(int, required=False),
        "deadline": _f(float, int, required=False),
        "discard": _f(int, required=False),
    },
    "opened": {"req": STR, "offset": INT, "chunk_bytes": INT},
    "commit": {"req": STR, "layer": INT},
    # Layers up to ``layer`` are placed in the receiver's memory: their
    # staging may be reused.
    "sent": {"req": STR, "layer": INT},
    "finished": {"req": STR, "checksum": INT, "timings": DICT},
    "abort": {"req": STR},
    "failed": {"req": STR, "error": ERROR},
    # Experiments run by the daemon (kvctl run): progress, one row per
    # finished measurement, then the result or ``failed``.
    "run": {"req": STR, "experiment": STR, "params": DICT},
    "progress": {"req": STR, "phase": STR, "done": INT, "total": INT},
    "row": {"req": STR, "row": DICT},
    "result": {"req": STR, "result": DICT},
    "error": {"error": ERROR},
}

# Decode engine <-> receiver daemon, over the receiver's unix socket.
RECEIVER_LOCAL: Schema = {
    "hello": {"role": STR},
    "welcome": {"name": STR, "pool_size": INT},
    "subscribe": {"req": STR},
    "layer": {"req": STR, "layer": INT},
    "complete": {
        "req": STR,
        "offset": INT,
        "length": INT,
        "layers": INT,
        "checksum": INT,
    },
    "release": {"req": STR},
    "released": {"req": STR},
    "failed": {"req": STR, "error": ERROR},
    "error": {"error": ERROR},
}


def message(kind: str, **fields: Any) -> Message:
    return {"t": kind, "v": PROTOCOL_VERSION, **fields}


def error_message(error: KvwireError) -> Message:
    return message("error", error=error.to_wire())


def encode(msg: Message) -> bytes:
    body: bytes = msgpack.packb(msg, use_bin_type=True)
    if len(body) > MAX_FRAME:
        raise FrameTooLarge(f"refusing to send a {len(body)} B frame (limit {MAX_FRAME} B)")
    return _LENGTH.pack(len(body)) + body


def decode(body: bytes, schema: Schema) -> Message:
    """Unpack and validate one frame body against ``schema``."""
    try:
        msg = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"frame is not valid msgpack: {exc}") from exc
    return validate(msg, schema)


def validate(msg: object, schema: Schema) -> Message:
    if not isinstance(msg, dict):
        raise ProtocolError(f"frame is a {type(msg).__name__}, not a map")
    version = msg.get("v")
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(
            f"peer speaks kvwire protocol version {version!r}, this side speaks "
            f"{PROTOCOL_VERSION}",
            hint="run the same kvwire release on both ends",
        )
    kind = msg.get("t")
    if not isinstance(kind, str) or kind not in schema:
        raise ProtocolError(
            f"unknown message type {kind!r}",
            hint=f"expected one of {', '.join(sorted(schema))}",
        )
    for name, field in schema[kind].items():
        if name not in msg or msg[name] is None:
            if field.required:
                raise ProtocolError(f"{kind!r} message lacks field {name!r}")
            continue
        value = msg[name]
        # bool is an int in Python; no field of ours is a bool.
        if isinstance(value, bool) or not isinstance(value, field.types):
            wanted = " or ".join(t.__name__ for t in field.types)
            raise ProtocolError(
                f"{kind!r} field {name!r} is {type(value).__name__}, expected {wanted}"
            )
    return msg


class FrameDecoder:
    """Bytes in, validated messages out; one per channel direction.

    ``next_message`` returns None until a whole frame is buffered. A frame
    announced larger than ``max_frame`` is refused from its header alone,
    so a peer cannot make us buffer it.
    """

    def __init__(self, schema: Schema, max_frame: int = MAX_FRAME) -> None:
        self.schema = schema
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
        return decode(body, self.schema)

    def end_of_stream(self) -> None:
        """The peer closed: fine between frames, a ProtocolError inside one."""
        if self.buffered == 0:
            return
        if self.buffered < _LENGTH.size:
            raise ProtocolError("stream ended inside a frame header")
        (length,) = _LENGTH.unpack_from(self._buffer, self._start)
        raise ProtocolError(
            f"stream ended inside a frame ({self.buffered - _LENGTH.size} of {length} B)")
