from __future__ import annotations

import asyncio
import struct
from typing import Any

import msgpack
import pytest

from kvwired.errors import (
    FrameTooLarge,
    PoolFull,
    ProtocolError,
    RequestTooLarge,
    VersionMismatch,
    from_wire,
)
from kvwired.protocol import (
    CONTROL,
    MAX_FRAME,
    RECEIVER_LOCAL,
    SENDER_LOCAL,
    Schema,
    decode,
    encode,
    message,
    read_message,
)

ERR = {"code": "pool_full", "message": "m", "hint": "h"}
EXAMPLES: list[tuple[Schema, dict[str, Any]]] = [
    (CONTROL, message("hello", role="sender", name="p", transports=["tcp"])),
    (CONTROL, message("welcome", name="d", transport="tcp", credits=64)),
    (CONTROL, message("connect", params={})),
    (CONTROL, message("ready", params={"host": "h", "port": 1, "token": b"\x00" * 16})),
    (CONTROL, message("open", req="r", shape={"layers": 24, "layer_bytes": 2 << 20})),
    (CONTROL, message("lease", req="r", lease=7, offset=4096)),
    (CONTROL, message("refused", req="r", error=ERR)),
    (CONTROL, message("abort", req="r", lease=7, error=ERR)),
    (CONTROL, message("abort_ack", req="r", lease=7)),
    (CONTROL, message("delivered", req="r", lease=7, checksum=123)),
    (CONTROL, message("credits", n=3)),
    (CONTROL, message("ping")),
    (CONTROL, message("error", error=ERR)),
    (SENDER_LOCAL, message("open", req="r", peer="d", shape={}, chunk_bytes=512,
                           deadline=1.5)),
    (SENDER_LOCAL, message("open", req="r", peer="d", shape={})),
    (SENDER_LOCAL, message("commit", req="r", layer=3)),
    (SENDER_LOCAL, message("finished", req="r", checksum=1, timings={"x": 1.0})),
    (RECEIVER_LOCAL, message("complete", req="r", offset=0, length=9, layers=1, checksum=5)),
    (RECEIVER_LOCAL, message("release", req="r")),
]


@pytest.mark.parametrize(("schema", "msg"), EXAMPLES, ids=lambda x: str(x.get("t", "")))
def test_round_trip(schema: Schema, msg: dict[str, Any]) -> None:
    frame = encode(msg)
    (length,) = struct.unpack(">I", frame[:4])
    assert length == len(frame) - 4
    assert decode(frame[4:], schema) == msg


def _body(obj: object) -> bytes:
    return bytes(msgpack.packb(obj, use_bin_type=True))


@pytest.mark.parametrize(
    ("body", "error", "text"),
    [
        (b"\xc1\xc1\xc1", ProtocolError, "not valid msgpack"),
        (_body([1, 2, 3]), ProtocolError, "not a map"),
        (_body({"t": "hello", "v": 99, "role": "sender", "name": "p", "transports": []}),
         VersionMismatch, "version 99"),
        (_body({"t": "hello", "role": "sender"}), VersionMismatch, "version None"),
        (_body({"t": "teleport", "v": 1}), ProtocolError, "unknown message type"),
        (_body({"t": "lease", "v": 1, "req": "r", "lease": 1}), ProtocolError, "lacks field"),
        (_body({"t": "lease", "v": 1, "req": "r", "lease": "1", "offset": 0}),
         ProtocolError, "expected int"),
        (_body({"t": "credits", "v": 1, "n": True}), ProtocolError, "is bool"),
    ],
)
def test_malformed_frames_are_rejected_with_reason(
    body: bytes, error: type[Exception], text: str
) -> None:
    with pytest.raises(error, match=text):
        decode(body, CONTROL)


async def _read(data: bytes) -> dict[str, Any] | None:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return await read_message(reader, CONTROL)


async def test_stream_framing() -> None:
    assert await _read(encode(message("ping"))) == message("ping")
    assert await _read(b"") is None  # clean end of stream


async def test_oversized_frame_is_refused_before_reading_it() -> None:
    with pytest.raises(FrameTooLarge, match="limit"):
        await _read(struct.pack(">I", MAX_FRAME + 1))


async def test_truncated_frames() -> None:
    with pytest.raises(ProtocolError, match="inside a frame header"):
        await _read(b"\x00\x00")
    with pytest.raises(ProtocolError, match="inside a frame"):
        await _read(struct.pack(">I", 100) + b"abc")


def test_refuses_to_send_oversized_frame() -> None:
    with pytest.raises(FrameTooLarge):
        encode(message("error", error={"message": "x" * (MAX_FRAME + 1)}))


def test_errors_cross_the_wire_as_themselves() -> None:
    error = PoolFull("no room", hint="release something")
    rebuilt = from_wire(error.to_wire())
    assert type(rebuilt) is PoolFull
    assert (rebuilt.message, rebuilt.hint) == ("no room", "release something")
    assert type(from_wire(RequestTooLarge("big").to_wire())) is RequestTooLarge
    assert type(from_wire({"code": "from-the-future"})).__name__ == "KvwireError"
