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

import math
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from . import immediate, stripes
from .errors import (
    FrameTooLarge,
    InvalidRequest,
    KvwireError,
    ProtocolError,
    VersionMismatch,
)

PROTOCOL_VERSION = 6
# An engine's ``peer`` that lets the sender choose (discovery: the connected
# receiver with the most free pool). No receiver may be named so.
AUTO_PEER = "auto"
MAX_FRAME = 1 << 20
_LENGTH = struct.Struct(">I")

Message = dict[str, Any]


# Checks a value of the right type; returns what is wrong with it, or None.
Check = Callable[[Any], str | None]


@dataclass(frozen=True)
class Field:
    types: tuple[type, ...]
    required: bool = True
    check: Check | None = None
    expected: str = ""  # what a good value looks like, for the refusal's hint


def _f(*types: type, required: bool = True, check: Check | None = None,
       expected: str = "") -> Field:
    return Field(types, required, check, expected)


def _int_range(low: int, high: int) -> Check:
    def check(value: Any) -> str | None:
        return None if low <= value <= high else f"{value} is outside {low}..{high}"
    return check


def _seconds(value: Any) -> str | None:
    if not math.isfinite(value) or value <= 0 or value > MAX_SECONDS:
        return f"{value!r} is not a number of seconds in (0, {MAX_SECONDS:g}]"
    return None


def _text(limit: int) -> Check:
    def check(value: Any) -> str | None:
        return None if 0 < len(value) <= limit else f"length {len(value)} is not 1..{limit}"
    return check


def _shape(value: Any) -> str | None:
    extra = set(value) - {"layers", "layer_bytes"}
    if extra:
        return f"unknown keys {sorted(map(str, extra))}"
    for key, high in (("layers", immediate.MAX_LAYERS), ("layer_bytes", MAX_LAYER_BYTES)):
        item = value.get(key)
        if isinstance(item, bool) or not isinstance(item, int):
            return f"{key!r} is {type(item).__name__}, expected int"
        if not 1 <= item <= high:
            return f"{key!r} {item} is outside 1..{high}"
    return None


def _error(value: Any) -> str | None:
    for key in ("code", "message"):
        if not isinstance(value.get(key), str):
            return f"{key!r} is missing or not a string"
    for key in ("hint", "status"):
        if key in value and not isinstance(value[key], str):
            return f"{key!r} is not a string"
    return None


def _keys(value: Any) -> str | None:
    if not 1 <= len(value) <= stripes.MAX_CHANNELS:
        return f"{len(value)} keys, not 1..{stripes.MAX_CHANNELS}"
    for key in value:
        if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < 1 << 32:
            return f"{key!r} is not a 32-bit remote key"
    return None


def _lease_keys(value: Any) -> str | None:
    if len(value) >= immediate.LEASE_SPACE:
        return f"{len(value)} pairs, more than there are leases"
    for pair in value:
        if (not isinstance(pair, list) or len(pair) != 2
                or any(isinstance(v, bool) or not isinstance(v, int) for v in pair)):
            return f"{pair!r} is not a [lease, key] pair of integers"
        lease, key = pair
        if not 1 <= lease < immediate.LEASE_SPACE or not 0 <= key < 1 << 32:
            return f"{pair!r}: lease or key out of range"
    return None


def _names(value: Any) -> str | None:
    if len(value) > 16 or not all(isinstance(v, str) and 0 < len(v) <= 64 for v in value):
        return "not a list of at most 16 short names"
    return None


MAX_SECONDS = 86400.0  # a deadline or wait longer than a day is a mistake
MAX_LAYER_BYTES = 1 << 40
U64 = (1 << 64) - 1

INT = _f(int, check=_int_range(0, U64), expected="a non-negative integer")
FLAG = _f(int, required=False, check=_int_range(0, 1), expected="0 or 1")
STR = _f(str, check=_text(1024), expected="a string of 1 to 1024 characters")
REQ = _f(str, check=_text(256), expected="a request id of 1 to 256 characters")
LEASE = _f(int, check=_int_range(1, immediate.LEASE_SPACE - 1),
           expected=f"a lease id in 1..{immediate.LEASE_SPACE - 1}")
LAYER = _f(int, check=_int_range(0, immediate.MAX_LAYERS - 1),
           expected=f"a layer in 0..{immediate.MAX_LAYERS - 1}")
CREDITS = _f(int, check=_int_range(1, 1 << 16), expected="1 to 65536 credits")
CHECKSUM = _f(int, check=_int_range(0, U64), expected="an unsigned 64-bit checksum")
KEY = _f(int, check=_int_range(0, (1 << 32) - 1), expected="a 32-bit remote key")
KEYS = _f(list, check=_keys,
          expected=f"a list of 1 to {stripes.MAX_CHANNELS} 32-bit remote keys, one per channel")
CHANNEL = _f(int, required=False, check=_int_range(0, stripes.MAX_CHANNELS - 1),
             expected=f"a data channel in 0..{stripes.MAX_CHANNELS - 1}")
SHAPE = _f(dict, check=_shape, expected="{layers: 1..1024, layer_bytes: 1..2^40}")
DICT = _f(dict)
ERROR = _f(dict, check=_error, expected="{code, message[, hint, status]} strings")
NAMES = _f(list, check=_names, expected="a list of names")
SECONDS = _f(float, int, required=False, check=_seconds,
             expected=f"seconds, finite, in (0, {MAX_SECONDS:g}]")
VERDICTS = ("delivered", "aborted", "unknown")
OUTCOME = _f(str, check=lambda v: None if v in VERDICTS else f"{v!r} is not a verdict",
             expected=" or ".join(VERDICTS))

Schema = Mapping[str, Mapping[str, Field]]

# Sender daemon <-> receiver daemon, over TCP.
CONTROL: Schema = {
    "hello": {"role": STR, "name": STR, "transports": NAMES},
    "welcome": {"name": STR, "transport": STR, "credits": CREDITS},
    # One data channel: in the handshake, then once per further channel
    # (qps_per_peer), each answered by its ``ready``.
    "connect": {"params": DICT},
    "ready": {"params": DICT},
    # A data channel that failed under a live control connection, replaced in
    # place: the receiver's new responder for it, and new keys for the
    # leases that still take writes, as [lease, key] pairs (the old keys died
    # with the old responder).
    "replace": {"req": REQ, "channel": _f(int, check=_int_range(0, stripes.MAX_CHANNELS - 1),
                                          expected=f"a data channel in 0.."
                                                   f"{stripes.MAX_CHANNELS - 1}"),
                "params": DICT},
    "replaced": {"req": REQ, "params": DICT, "keys": _f(list, check=_lease_keys,
                                                         expected="[lease, key] pairs")},
    # discard=1: an experiment's request, freed as soon as it is delivered.
    "open": {"req": REQ, "shape": SHAPE, "discard": FLAG},
    # keys: the remote keys for this lease's bytes alone, one per data
    # channel the session had when it was granted, live while it fills.
    "lease": {"req": REQ, "lease": LEASE, "offset": INT, "keys": KEYS},
    "refused": {"req": REQ, "error": ERROR},
    "abort": {"req": REQ, "lease": LEASE, "error": ERROR},
    "abort_ack": {"req": REQ, "lease": LEASE},
    "delivered": {"req": REQ, "lease": LEASE, "checksum": CHECKSUM},
    # A request the sender gave up before asking for a lease (its staging
    # full, its deadline): the receiver tells the decode engines waiting for it.
    "withdrawn": {"req": REQ, "error": ERROR},
    # A sender that lost its connection after posting a lease's last layer
    # asks how it ended (kvwired.verdicts); the receiver waits for a lease
    # still being decided, and says "unknown" for one it never held or forgot.
    "ask": {"req": REQ, "lease": LEASE},
    "verdict": {"req": REQ, "lease": LEASE, "outcome": OUTCOME,
                "checksum": _f(int, required=False, check=_int_range(0, U64),
                               expected="an unsigned 64-bit checksum"),
                "error": _f(dict, required=False, check=_error,
                            expected="{code, message[, hint, status]} strings")},
    # Credits of one data channel's receives (the first one's when absent).
    "credits": {"n": CREDITS, "channel": CHANNEL},
    # Echo mode (kvctl run chunk-sweep): the receiver leases a slot and opens a
    # data channel back to the sender; an immediate naming the echo lease is
    # answered by a write of the same size (sizes[layer bits]) with the same
    # immediate.
    "echo_open": {"req": REQ, "bytes": INT, "sizes": _f(list)},
    "echo_offer": {"req": REQ, "lease": LEASE, "offset": INT, "key": KEY, "params": DICT},
    "echo_answer": {"req": REQ, "lease": LEASE, "reply_offset": INT, "params": DICT},
    "echo_ready": {"req": REQ, "lease": LEASE},
    # ``answers``: echo answers the sender has seen, each a credit back.
    "echo_close": {"req": REQ, "lease": LEASE, "answers": INT},
    # The perftest baseline: the receiver runs the tool's server side.
    "baseline": {"req": REQ, "tool": STR, "size": INT, "iters": INT},
    "baseline_ready": {"req": REQ, "port": _f(int, check=_int_range(1, 65535),
                                               expected="a TCP port")},
    "baseline_stop": {"req": REQ},
    "ping": {},
    "pong": {},
    # A clean goodbye: the daemon is shutting down (or the peer was removed).
    "bye": {"reason": STR},
    "error": {"error": ERROR},
}

# What a receiver sends in answer to a sender's request (matched by ``req``).
CONTROL_ANSWERS = frozenset({"lease", "refused", "verdict", "replaced", "echo_offer",
                             "echo_ready", "baseline_ready"})

# Prefill engine <-> sender daemon, over the sender's unix socket.
SENDER_LOCAL: Schema = {
    "hello": {"role": STR},
    "welcome": {"name": STR, "pool_size": INT, "peers": _f(list, required=False)},
    "open": {
        "req": REQ,
        "peer": STR,
        "shape": SHAPE,
        "chunk_bytes": _f(int, required=False, check=_int_range(1, MAX_LAYER_BYTES << 10),
                          expected="a chunk size of at least 1 B"),
        "deadline": SECONDS,
        "discard": FLAG,
    },
    # ``peer``: the receiver the push goes to (the one chosen, for "auto");
    # ``lease``: the receiver's lease, by which an engine can ask later.
    "opened": {"req": REQ, "peer": STR, "offset": INT, "chunk_bytes": INT, "lease": LEASE},
    "commit": {"req": REQ, "layer": LAYER},
    # Layers up to ``layer`` are placed in the receiver's memory: their
    # staging may be reused.
    "sent": {"req": REQ, "layer": LAYER},
    "finished": {"req": REQ, "checksum": CHECKSUM, "timings": DICT},
    "abort": {"req": REQ},
    # An engine whose daemon went away after it committed every layer asks the
    # restarted daemon how the request ended: ``finished`` or ``failed`` answers.
    "ask": {"req": REQ, "peer": STR, "lease": LEASE},
    "failed": {"req": REQ, "error": ERROR},
    # After finished/failed: the engine holds no view of the request's
    # staging any more, so the daemon may reuse it.
    "dropped": {"req": REQ},
    # Experiments run by the daemon (kvctl run): progress, one row per
    # finished measurement, then the result or ``failed``.
    "run": {"req": REQ, "experiment": STR, "params": DICT},
    "progress": {"req": REQ, "phase": STR, "done": INT, "total": INT},
    "row": {"req": REQ, "row": DICT},
    "result": {"req": REQ, "result": DICT},
    "error": {"error": ERROR},
}

# Decode engine <-> receiver daemon, over the receiver's unix socket.
RECEIVER_LOCAL: Schema = {
    "hello": {"role": STR},
    "welcome": {"name": STR, "pool_size": INT},
    "subscribe": {"req": REQ},
    # Where the request lies in the pool (the receiver's slot), on each layer:
    # an engine may read a landed layer before the whole request is in.
    "layer": {"req": REQ, "layer": LAYER,
              "offset": _f(int, required=False, check=_int_range(0, U64)),
              "length": _f(int, required=False, check=_int_range(0, U64))},
    "complete": {
        "req": REQ,
        "offset": INT,
        "length": INT,
        "layers": INT,
        "checksum": CHECKSUM,
    },
    "release": {"req": REQ},
    "released": {"req": REQ},
    # Stop holding a request without releasing it: the receiver keeps it for
    # another engine, as if nobody had subscribed (unclaimed_ttl).
    "unsubscribe": {"req": REQ},
    "unsubscribed": {"req": REQ},
    "failed": {"req": REQ, "error": ERROR},
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
    fields = schema[kind]
    try:
        _check_fields(kind, msg, fields)
    except ProtocolError as exc:
        req = msg.get("req")
        if "req" in fields and isinstance(req, str) and REQ.check is not None \
                and REQ.check(req) is None:
            # The frame is whole and names its request: only that request is bad.
            raise InvalidRequest(exc.message, hint=exc.hint, req=req) from None
        raise
    return msg


def _check_fields(kind: str, msg: dict[str, Any], fields: Mapping[str, Field]) -> None:
    for name, field in fields.items():
        if name not in msg or msg[name] is None:
            if field.required:
                raise ProtocolError(f"{kind!r} message lacks field {name!r}")
            continue
        value = msg[name]
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
