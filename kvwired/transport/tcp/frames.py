"""The TCP data path's frames, with no I/O: one header, one decoder, both directions.

Little-endian, 32 bytes:

    op u8 | flags u8 | pad u16 | rkey u32 | imm u32 | length u32 | offset u64 | wr_id u64

The initiator sends WRITE frames (header, then ``length`` bytes of payload);
the responder answers a signalled write with ACK, and a write it refuses
with NAK (the initiator's remote access error). Each direction accepts only
its own opcodes: anything else is a broken or hostile peer, a
``TransportError`` that ends the connection. ``decode_header`` is the only
place a header is read; ``AnswerDecoder`` is the initiator's whole parser,
fed bytes as they arrive (h11's ``receive_data``/``next_event``). The
responder's is ``write_receiver``, which reads payloads straight into the
pool, so it calls ``decode_header`` on its own buffer rather than going
through a decoder that would own one.
"""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import NamedTuple

from ...errors import TransportError

HEADER = struct.Struct("<BBxxIIIQQ")
TOKEN_BYTES = 16  # a data connection's first bytes: its session's token
FLAG_SIGNALED = 1  # answer with ACK once placed (the initiator's completion)
FLAG_IMM = 2  # ``imm`` is the write's immediate


class Op(IntEnum):
    WRITE = 1
    ACK = 2
    NAK = 3  # a write refused (remote access error); the connection ends


# What each end may receive.
TO_RESPONDER = frozenset({Op.WRITE})
TO_INITIATOR = frozenset({Op.ACK, Op.NAK})

# The hot path packs and unpacks plain tuples: a 512 B chunk is one frame,
# and building an object per frame cost 10 % of a 98,304-write push.
pack_header = HEADER.pack
WRITE = int(Op.WRITE)
Fields = tuple[int, int, int, int, int, int, int]


class Header(NamedTuple):
    """One frame's header (a tuple: one is decoded per write on the hot path)."""

    op: int
    flags: int
    key: int
    imm: int
    length: int
    offset: int
    wr_id: int

    @property
    def signaled(self) -> bool:
        return bool(self.flags & FLAG_SIGNALED)

    @property
    def has_immediate(self) -> bool:
        return bool(self.flags & FLAG_IMM)


def decode_header(buffer: bytes | bytearray | memoryview, start: int,
                  allowed: frozenset[Op]) -> Fields:
    """The header's fields at ``start`` (op, flags, key, imm, length, offset,
    wr_id); a TransportError if its opcode is not one this end takes."""
    fields: Fields = HEADER.unpack_from(buffer, start)
    if fields[0] not in allowed:
        raise TransportError(f"unexpected data-path opcode {fields[0]}",
                             hint="the peer is not a kvwire TCP data endpoint of this "
                                  "version, or is broken")
    return fields


def encode_write(flags: int, key: int, imm: int, length: int, offset: int,
                 wr_id: int) -> bytes:
    return pack_header(WRITE, flags, key, imm, length, offset, wr_id)


def encode_answer(op: Op, wr_id: int) -> bytes:
    """An ACK or a NAK of the write ``wr_id``."""
    return HEADER.pack(op, 0, 0, 0, 0, 0, wr_id)


class AnswerDecoder:
    """The initiator's side: bytes in, ACK and NAK headers out."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._start = 0

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if self._start:
            del self._buffer[: self._start]
            self._start = 0
        self._buffer += data

    def next_answer(self) -> Header | None:
        """The next whole answer, or None until one is buffered."""
        if len(self._buffer) - self._start < HEADER.size:
            return None
        header = Header._make(decode_header(self._buffer, self._start, TO_INITIATOR))
        self._start += HEADER.size
        return header

    @property
    def buffered(self) -> int:
        return len(self._buffer) - self._start
