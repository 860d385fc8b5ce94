from __future__ import annotations

import asyncio
import contextlib
import itertools
import struct
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

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
    PROTOCOL_VERSION,
    RECEIVER_LOCAL,
    SENDER_LOCAL,
    Channel,
    FrameDecoder,
    RawMessage,
    decode,
    encode,
    message,
)
from kvwired.protocol import control as ctl
from kvwired.stream import MessageStream

ERR = {"code": "pool_full", "message": "m", "hint": "h"}
SHAPE_OK = {"layers": 24, "layer_bytes": 2 << 20}
NOTE_OK = {"attention": "mha", "dtype": "float32", "block_size": 128, "head_bytes": 32768}
EXAMPLES: list[tuple[Channel, dict[str, Any]]] = [
    (CONTROL, message("hello", role="sender", name="p", transports=["tcp"])),
    (CONTROL, message("welcome", name="d", transport="tcp", credits=64)),
    (CONTROL, message("connect", params={})),
    (CONTROL, message("ready", params={"host": "h", "port": 1, "token": b"\x00" * 16})),
    (CONTROL, message("open", req="r", shape={"layers": 24, "layer_bytes": 2 << 20})),
    (CONTROL, message("lease", req="r", lease=7, offset=4096, keys=[9])),
    (CONTROL, message("refused", req="r", error=ERR)),
    (CONTROL, message("abort", req="r", lease=7, error=ERR)),
    (CONTROL, message("abort_ack", req="r", lease=7)),
    (CONTROL, message("delivered", req="r", lease=7, checksum=123)),
    (CONTROL, message("credits", n=3)),
    (CONTROL, message("ping")),
    (CONTROL, message("error", error=ERR)),
    (SENDER_LOCAL, message("open", req="r", peer="d", shape=SHAPE_OK, chunk_bytes=512,
                           deadline=1.5)),
    (SENDER_LOCAL, message("open", req="r", peer="d", shape=SHAPE_OK)),
    (SENDER_LOCAL, message("commit", req="r", layer=3)),
    (SENDER_LOCAL, message("finished", req="r", checksum=1, timings={"x": 1.0})),
    (CONTROL, message("open", req="r", shape={"layers": 2, "layer_bytes": 64},
                      note={"dtype": "float16", "block_size": 16, "tp": 2, "x": None})),
    (SENDER_LOCAL, message("open", req="r", peer="d", shape=SHAPE_OK, note=NOTE_OK)),
    (RECEIVER_LOCAL, message("opened", req="r", note=NOTE_OK)),
    (RECEIVER_LOCAL, message("opened", req="r")),
    (RECEIVER_LOCAL, message("complete", req="r", offset=0, length=9, layers=1, checksum=5)),
    (RECEIVER_LOCAL, message("release", req="r")),
]


@pytest.mark.parametrize(("schema", "msg"), EXAMPLES, ids=lambda x: str(x.get("t", "")))
def test_round_trip(schema: Channel, msg: dict[str, Any]) -> None:
    frame = encode(msg)
    (length,) = struct.unpack(">I", frame[:4])
    assert length == len(frame) - 4
    typed = decode(frame[4:], schema)
    assert isinstance(typed, schema.types[msg["t"]])
    assert typed.to_wire() == msg
    # The typed message is the same frame: old and new ends read each other.
    assert decode(encode(typed)[4:], schema) == typed


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
        (_body({"t": "teleport", "v": PROTOCOL_VERSION}), ProtocolError, "unknown message type"),
        (_body({"t": "lease", "v": PROTOCOL_VERSION, "req": "r", "lease": 1}), ProtocolError,
         "lacks field"),
        (_body({"t": "lease", "v": PROTOCOL_VERSION, "req": "r", "lease": "1", "offset": 0}),
         ProtocolError, "expected int"),
        (_body({"t": "credits", "v": PROTOCOL_VERSION, "n": True}), ProtocolError, "is bool"),
        # A release before per-channel keys: one key, where a list is due.
        (_body({"t": "lease", "v": PROTOCOL_VERSION, "req": "r", "lease": 1, "offset": 0,
                "key": 9}), ProtocolError, "lacks field 'keys'"),
    ],
)
def test_malformed_frames_are_rejected_with_reason(
    body: bytes, error: type[Exception], text: str
) -> None:
    with pytest.raises(error, match=text):
        decode(body, CONTROL)


SCHEMAS = {"control": CONTROL, "sender_local": SENDER_LOCAL, "receiver_local": RECEIVER_LOCAL}


def _decode_all(data: bytes, pieces: list[int] | None = None,
                schema: Channel = CONTROL) -> list[RawMessage]:
    """Feed ``data`` cut at ``pieces`` offsets; every message, then the end of stream."""
    decoder = FrameDecoder(schema)
    cuts = sorted({0, len(data), *(p % (len(data) + 1) for p in pieces or [])})
    out: list[RawMessage] = []
    for start, end in itertools.pairwise(cuts):
        decoder.feed(data[start:end])
        while (msg := decoder.next_message()) is not None:
            out.append(msg.to_wire())
    decoder.end_of_stream()
    return out


def test_decoder_frames_and_clean_end() -> None:
    assert _decode_all(encode(message("ping"))) == [message("ping")]
    assert _decode_all(b"") == []  # clean end of stream


def test_oversized_frame_is_refused_from_its_header_alone() -> None:
    decoder = FrameDecoder(CONTROL)
    decoder.feed(struct.pack(">I", MAX_FRAME + 1))
    with pytest.raises(FrameTooLarge, match="limit"):
        decoder.next_message()


def test_truncated_frames() -> None:
    with pytest.raises(ProtocolError, match="inside a frame header"):
        _decode_all(b"\x00\x00")
    with pytest.raises(ProtocolError, match="inside a frame"):
        _decode_all(struct.pack(">I", 100) + b"abc")


CONTROL_EXAMPLES = [msg for schema, msg in EXAMPLES if schema is CONTROL]


@given(st.lists(st.sampled_from(CONTROL_EXAMPLES), max_size=20),
       st.lists(st.integers(min_value=0, max_value=1 << 16), max_size=30))
def test_messages_survive_any_cutting_of_the_stream(
        messages: list[RawMessage], cuts: list[int]) -> None:
    data = b"".join(encode(msg) for msg in messages)
    assert _decode_all(data, cuts) == messages


@pytest.mark.parametrize("channel", sorted(SCHEMAS))
@given(data=st.binary(max_size=512),
       cuts=st.lists(st.integers(min_value=0, max_value=600), max_size=8))
def test_any_bytes_give_messages_or_a_protocol_error(
        channel: str, data: bytes, cuts: list[int]) -> None:
    with contextlib.suppress(ProtocolError):
        _decode_all(data, cuts, SCHEMAS[channel])


INT64 = st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1)


VALUES = (st.none() | st.booleans() | INT64 | st.floats() | st.text(max_size=8)
          | st.binary(max_size=8) | st.lists(INT64, max_size=3)
          | st.dictionaries(st.text(max_size=12), INT64 | st.floats() | st.text(max_size=4),
                            max_size=3))


@pytest.mark.parametrize("channel", sorted(SCHEMAS))
@given(fields=st.dictionaries(st.sampled_from(["req", "lease", "layer", "shape", "deadline",
                                               "offset", "error", "n", "peer", "chunk_bytes",
                                               "checksum", "note"]) | st.text(max_size=8),
                              VALUES, max_size=8),
       data=st.data())
def test_any_map_validates_or_is_a_protocol_error(
        channel: str, fields: dict[str, Any], data: st.DataObject) -> None:
    schema = SCHEMAS[channel]
    kind = data.draw(st.sampled_from(sorted(schema)))
    for candidate in (fields, {**fields, "t": kind, "v": PROTOCOL_VERSION}):
        try:
            msg = decode(_body(candidate), schema)
        except ProtocolError:
            continue
        assert isinstance(msg, schema.types[msg.kind])


async def test_message_stream_reads_through_the_decoder() -> None:
    reader = asyncio.StreamReader()
    data = encode(message("ping")) + encode(message("credits", n=2))
    for i in range(0, len(data), 3):  # as a slow peer would send it
        reader.feed_data(data[i : i + 3])
    reader.feed_eof()
    stream = MessageStream(reader, None, CONTROL)  # type: ignore[arg-type]
    assert await stream.receive() == ctl.Ping()
    assert await stream.receive() == ctl.Credits(n=2)
    assert await stream.receive() is None


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


def _open(**shape: object) -> dict[str, Any]:
    return message("open", req="r", shape=shape)


@pytest.mark.parametrize(("schema", "msg", "text"), [
    (CONTROL, _open(layers=float("inf"), layer_bytes=4096), "'layers' is float"),
    (CONTROL, _open(layers=0, layer_bytes=4096), "outside 1..1024"),
    (CONTROL, _open(layers=2000, layer_bytes=4096), "outside 1..1024"),
    (CONTROL, _open(layers=2, layer_bytes=-1), "outside 1..1099511627776"),
    (CONTROL, _open(layers=2), "'layer_bytes' is NoneType"),
    (CONTROL, _open(layers=2, layer_bytes=9, color="red"), "unknown keys"),
    (CONTROL, message("lease", req="r", lease=0, offset=0, keys=[9]), "outside 1..4194303"),
    (CONTROL, message("lease", req="r", lease=5, offset=-4096, keys=[9]), "outside 0.."),
    (CONTROL, message("credits", n=0), "outside 1..65536"),
    (CONTROL, message("credits", n=1, channel=16), "outside 0..15"),
    (CONTROL, message("credits", n=1, channel=-1), "outside 0..15"),
    (CONTROL, message("lease", req="r", lease=5, offset=0, keys=[]), "0 keys, not 1..16"),
    (CONTROL, message("lease", req="r", lease=5, offset=0, keys=[1] * 17), "17 keys"),
    (CONTROL, message("lease", req="r", lease=5, offset=0, keys=[1 << 32]),
     "not a 32-bit remote key"),
    (CONTROL, message("lease", req="r", lease=5, offset=0, keys=[True]),
     "not a 32-bit remote key"),
    (CONTROL, message("lease", req="r", lease=5, offset=0, keys=["7"]),
     "not a 32-bit remote key"),
    (CONTROL, message("abort", req="r", lease=5, error={"message": "m"}), "'code' is missing"),
    (CONTROL, message("lease", req="", lease=5, offset=0, keys=[9]), "length 0"),
    (CONTROL, message("lease", req="x" * 300, lease=5, offset=0, keys=[9]), "length 300"),
    (SENDER_LOCAL, message("open", req="r", peer="d", shape=SHAPE_OK,
                           deadline=float("nan")), "not a number of seconds"),
    (SENDER_LOCAL, message("open", req="r", peer="d", shape=SHAPE_OK,
                           deadline=float("inf")), "not a number of seconds"),
    (SENDER_LOCAL, message("open", req="r", peer="d", shape=SHAPE_OK, deadline=-1),
     "not a number of seconds"),
    (SENDER_LOCAL, message("open", req="r", peer="d", shape=SHAPE_OK, deadline="5"),
     "is str"),
    (SENDER_LOCAL, message("open", req="r", peer="d", shape=SHAPE_OK, chunk_bytes=0),
     "outside 1.."),
    (SENDER_LOCAL, message("commit", req="r", layer=1024), "outside 0..1023"),
    (SENDER_LOCAL, message("open", req="r", peer="d", shape=SHAPE_OK, discard=2),
     "outside 0..1"),
    # A note is the prefill engine's to the decode engine: flat and small.
    (SENDER_LOCAL, message("open", req="r", peer="d", shape=SHAPE_OK,
                           note={"layout": {"dtype": "float16"}}), "is dict, not a string"),
    (SENDER_LOCAL, message("open", req="r", peer="d", shape=SHAPE_OK,
                           note={f"k{n}": n for n in range(33)}), "33 entries"),
    (SENDER_LOCAL, message("open", req="r", peer="d", shape=SHAPE_OK, note={"k": "x" * 300}),
     "300 characters"),
    (CONTROL, message("open", req="r", shape=SHAPE_OK, note={"": 1}), "not a name"),
    (CONTROL, message("open", req="r", shape=SHAPE_OK, note={"k": [1, 2]}), "is list"),
    (RECEIVER_LOCAL, message("opened", req="r", note={"k": b"\x00"}), "is bytes"),
    (RECEIVER_LOCAL, message("opened", req="r", note=[1]), "is list"),
])
def test_values_out_of_range_are_refused_with_a_hint(
        schema: Channel, msg: dict[str, Any], text: str) -> None:
    with pytest.raises(ProtocolError, match=text) as refused:
        decode(_body(msg), schema)
    assert refused.value.hint.startswith("send ")
