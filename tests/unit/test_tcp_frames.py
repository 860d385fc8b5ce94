"""The TCP data path's frames, with no sockets: the one header decoder and the
initiator's answer decoder, under any bytes and any cutting of the stream."""

from __future__ import annotations

import contextlib
import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvwired.errors import TransportError
from kvwired.transport.tcp.frames import (
    FLAG_IMM,
    FLAG_SIGNALED,
    HEADER,
    TO_INITIATOR,
    TO_RESPONDER,
    AnswerDecoder,
    Header,
    Op,
    decode_header,
    encode_answer,
    encode_write,
)

U32 = st.integers(min_value=0, max_value=(1 << 32) - 1)
U64 = st.integers(min_value=0, max_value=(1 << 64) - 1)


def _answers(data: bytes, cuts: list[int]) -> list[Header]:
    decoder = AnswerDecoder()
    bounds = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    out: list[Header] = []
    for start, end in itertools.pairwise(bounds):
        decoder.feed(data[start:end])
        while (answer := decoder.next_answer()) is not None:
            out.append(answer)
    return out


@given(flags=st.sampled_from([0, FLAG_SIGNALED, FLAG_IMM, FLAG_SIGNALED | FLAG_IMM]),
       key=U32, imm=U32, length=U32, offset=U64, wr_id=U64)
def test_a_write_header_reads_back_as_written(flags: int, key: int, imm: int, length: int,
                                              offset: int, wr_id: int) -> None:
    frame = encode_write(flags, key, imm, length, offset, wr_id)
    assert len(frame) == HEADER.size == 32
    header = Header._make(decode_header(b"junk" + frame, 4, TO_RESPONDER))
    assert tuple(header) == (Op.WRITE, flags, key, imm, length, offset, wr_id)
    assert header.signaled == bool(flags & FLAG_SIGNALED)
    assert header.has_immediate == bool(flags & FLAG_IMM)


@given(ops=st.lists(st.tuples(st.sampled_from([Op.ACK, Op.NAK]), U64), max_size=20),
       cuts=st.lists(st.integers(min_value=0, max_value=1 << 10), max_size=12))
def test_answers_survive_any_cutting_of_the_stream(ops: list[tuple[Op, int]],
                                                   cuts: list[int]) -> None:
    data = b"".join(encode_answer(op, wr_id) for op, wr_id in ops)
    assert [(a.op, a.wr_id) for a in _answers(data, cuts)] == ops


@given(data=st.binary(max_size=400),
       cuts=st.lists(st.integers(min_value=0, max_value=500), max_size=8))
def test_any_bytes_give_answers_or_a_transport_error(data: bytes, cuts: list[int]) -> None:
    with contextlib.suppress(TransportError):
        for answer in _answers(data, cuts):
            assert answer.op in TO_INITIATOR


@given(data=st.binary(min_size=32, max_size=32))
def test_each_end_takes_only_its_own_opcodes(data: bytes) -> None:
    for allowed in (TO_RESPONDER, TO_INITIATOR):
        try:
            header = decode_header(data, 0, allowed)
        except TransportError as exc:
            assert data[0] not in allowed
            assert "opcode" in exc.message
        else:
            assert header[0] in allowed


def test_a_write_sent_to_the_initiator_breaks_the_stream() -> None:
    decoder = AnswerDecoder()
    decoder.feed(encode_answer(Op.ACK, 1) + encode_write(FLAG_SIGNALED, 1, 0, 0, 0, 2))
    answer = decoder.next_answer()
    assert answer is not None and answer.wr_id == 1
    with pytest.raises(TransportError, match="unexpected data-path opcode 1"):
        decoder.next_answer()
