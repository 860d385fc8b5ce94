"""The transports' I/O-free cores, with no device and no socket: the verbs
send queue's signal accounting, and the TCP write receiver under any
cutting of the stream and any bytes."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import cycle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvwired.errors import RemoteAccessError, TransportError
from kvwired.transport.base import Write
from kvwired.transport.tcp.frames import FLAG_IMM, FLAG_SIGNALED, encode_write
from kvwired.transport.tcp.write_receiver import (
    DIRECT_THRESHOLD,
    Landed,
    Refused,
    WriteReceiver,
)
from kvwired.transport.verbs.send_queue import Burst, Post, SendQueue

# --------------------------------------------------------- verbs send queue

DEPTH, EVERY = 16, 4


class SendQueueAlone(RuleBasedStateMachine):
    """Any sequence of posts, bursts and completions: the send queue never
    holds more than its depth, every posted work request is followed by a
    signalled one that frees it, the signals account for exactly what is
    outstanding, and each post ends once, in order, after all its writes."""

    def __init__(self) -> None:
        super().__init__()
        self.sq: SendQueue[int] = SendQueue(DEPTH, EVERY)
        self.posts = 0
        self.writes_of: dict[int, int] = {}
        self.on_queue: list[tuple[int, int | None]] = []  # (post, wr_id if signalled)
        self.ended: list[int] = []
        self.placed_of: dict[int, int] = {}

    @rule(writes=st.integers(1, 3 * DEPTH))
    def post(self, writes: int) -> None:
        self.sq.add(Post([Write(0, 0, 1)] * writes, None, 0, self.posts))
        self.writes_of[self.posts] = writes
        self.posts += 1

    @rule()
    def burst(self) -> None:
        burst: Burst[int] | None = self.sq.next_burst()
        if burst is None:
            assert self.sq.outstanding == DEPTH or self.sq.pending_writes == self.sq.outstanding
            return
        assert burst.end - burst.start <= DEPTH - self.sq.outstanding
        assert burst.end - 1 in burst.signalled, "a burst's last write is signalled"
        if burst.end == len(burst.post.writes):
            assert burst.last_of_post in burst.signalled
        run = 0
        for i in range(burst.start, burst.end):
            run = 0 if i in burst.signalled else run + 1
            assert run < EVERY
            self.on_queue.append((burst.post.done, burst.signalled.get(i)))
        self.sq.posted(burst)

    @precondition(lambda self: any(wr is not None for _, wr in self.on_queue))
    @rule()
    def complete(self) -> None:
        signals = [n for n, (_, wr) in enumerate(self.on_queue) if wr is not None]
        # Completions come in order: the first signalled one outstanding.
        upto = signals[0]
        wr_id = self.on_queue[upto][1]
        assert wr_id is not None
        freed, self.on_queue = self.on_queue[:upto + 1], self.on_queue[upto + 1:]
        for post, _ in freed:
            self.placed_of[post] = self.placed_of.get(post, 0) + 1
        ended = self.sq.completed(wr_id)
        for post in ended:
            assert self.placed_of[post] == self.writes_of[post], "ended after all its writes"
        self.ended += ended

    @invariant()
    def the_signals_account_for_what_is_outstanding(self) -> None:
        assert self.sq.outstanding == len(self.on_queue) <= DEPTH
        if self.on_queue:
            assert self.on_queue[-1][1] is not None, "nothing waits without a signal after it"

    @invariant()
    def posts_end_once_in_order(self) -> None:
        assert self.ended == sorted(set(self.ended))
        assert self.ended == list(range(len(self.ended)))

    def teardown(self) -> None:
        left = self.sq.take_outstanding()
        assert sorted(left + self.ended) == list(range(self.posts))
        assert self.sq.outstanding == 0 and self.sq.pending_writes == 0


TestSendQueueAlone = SendQueueAlone.TestCase


def test_a_long_post_is_signalled_every_quarter_of_the_queue_and_at_its_end() -> None:
    sq: SendQueue[str] = SendQueue(1024, 256)
    sq.add(Post([Write(0, 0, 8)] * 600, 7, 1, "layer"))
    burst = sq.next_burst()
    assert burst is not None
    assert sorted(burst.signalled) == [255, 511, 599]
    sq.posted(burst)
    assert sq.outstanding == 600 and sq.next_burst() is None
    assert sq.completed(burst.signalled[255]) == []
    assert sq.outstanding == 344
    assert sq.completed(burst.signalled[599]) == ["layer"]
    assert sq.outstanding == 0


# -------------------------------------------------------- tcp write receiver

MEMORY = 4 * DIRECT_THRESHOLD
KEY = 0x1234


def _check(key: int, offset: int, length: int) -> None:
    if key != KEY or offset < 0 or offset + length > MEMORY:
        raise RemoteAccessError(f"write of {length} B at {offset} under {key:#x}")


writes_st = st.lists(st.tuples(
    st.integers(0, MEMORY - 1),  # offset
    st.sampled_from([0, 1, 512, 4096, DIRECT_THRESHOLD - 1, DIRECT_THRESHOLD,
                     DIRECT_THRESHOLD + 7]),
    st.booleans(),  # signalled
    st.one_of(st.none(), st.integers(0, 2**32 - 1)),  # immediate
), min_size=1, max_size=8)


def _stream(writes: list[tuple[int, int, bool, int | None]]
            ) -> tuple[bytes, bytearray, list[Landed]]:
    stream, expected, landed = bytearray(), bytearray(MEMORY), []
    for n, (offset, length, signalled, imm) in enumerate(writes):
        length = min(length, MEMORY - offset)
        payload = bytes((n + i) % 251 for i in range(length))
        flags = (FLAG_SIGNALED if signalled else 0) | (FLAG_IMM if imm is not None else 0)
        stream += encode_write(flags, KEY, imm or 0, length, offset, n) + payload
        expected[offset:offset + length] = payload
        landed.append((flags, imm or 0, n))
    return bytes(stream), expected, landed


def _feed(receiver: WriteReceiver, stream: bytes, cuts: Iterator[int]) -> list[object]:
    """Feed ``stream`` as recv_into would: never more than ``buffer()`` has room for."""
    events: list[object] = []
    at = 0
    while at < len(stream):
        room = receiver.buffer()
        n = min(len(room), len(stream) - at, next(cuts))
        room[:n] = stream[at:at + n]
        at += n
        events += receiver.received(n)
    return events


@settings(max_examples=150, deadline=None)
@given(writes_st, st.lists(st.integers(1, 3 * DIRECT_THRESHOLD), min_size=1))
def test_every_write_lands_whole_and_in_order_however_the_stream_is_cut(
        writes: list[tuple[int, int, bool, int | None]], cut_sizes: list[int]) -> None:
    stream, expected, landed = _stream(writes)
    memory = bytearray(MEMORY)
    receiver = WriteReceiver(memoryview(memory), _check, bounce_bytes=4 * DIRECT_THRESHOLD)
    assert _feed(receiver, stream, cycle(cut_sizes)) == landed
    assert memory == expected
    assert receiver.landing_under is None


def test_a_large_write_lands_in_place_and_says_so_until_it_is_whole() -> None:
    memory = bytearray(MEMORY)
    receiver = WriteReceiver(memoryview(memory), _check)
    stream = encode_write(FLAG_SIGNALED, KEY, 0, 2 * DIRECT_THRESHOLD, 0, 9) \
        + b"x" * 2 * DIRECT_THRESHOLD
    room = receiver.buffer()
    room[:1000] = stream[:1000]
    assert receiver.received(1000) == []
    assert receiver.landing_under == KEY
    room = receiver.buffer()
    assert len(room) == 2 * DIRECT_THRESHOLD - (1000 - 32), "the rest goes straight to the pool"
    room[:] = stream[1000:]
    assert receiver.received(len(room)) == [(FLAG_SIGNALED, 0, 9)]
    assert receiver.landing_under is None and memory[:2 * DIRECT_THRESHOLD] == stream[32:]


def test_a_write_outside_its_grant_is_refused_before_a_byte_lands_and_the_rest_dropped() -> None:
    memory = bytearray(MEMORY)
    receiver = WriteReceiver(memoryview(memory), _check)
    stream = (encode_write(FLAG_SIGNALED, KEY, 0, 4, 0, 1) + b"good"
              + encode_write(FLAG_SIGNALED, KEY + 1, 0, 4, 8, 2) + b"evil"
              + encode_write(FLAG_SIGNALED, KEY, 0, 4, 16, 3) + b"late")
    events = _feed(receiver, stream, cycle([len(stream)]))
    assert events == [(FLAG_SIGNALED, 0, 1)]
    assert isinstance(receiver.refusal, Refused) and receiver.refusal.wr_id == 2
    assert memory[:4] == b"good" and memory[4:] == bytes(MEMORY - 4)
    assert list(receiver.received(4)) == []


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=4096), st.integers(1, 512))
def test_any_bytes_at_all_end_in_events_or_a_transport_error(junk: bytes, cut: int) -> None:
    """An adversary's stream: nothing but landed writes, refusals or a
    TransportError, and nothing written outside what a key grants."""
    memory = bytearray(MEMORY)
    receiver = WriteReceiver(memoryview(memory), _check)
    try:
        events = _feed(receiver, junk, cycle([cut]))
    except TransportError as exc:
        assert "opcode" in exc.message
        return
    assert all(isinstance(event, tuple) and len(event) == 3 for event in events)
    assert receiver.refusal is None or isinstance(receiver.refusal.error, RemoteAccessError)


def test_a_frame_no_initiator_sends_is_a_transport_error() -> None:
    receiver = WriteReceiver(memoryview(bytearray(MEMORY)), _check)
    room = receiver.buffer()
    bad = bytes([9]) + bytes(31)
    room[:32] = bad
    with pytest.raises(TransportError, match="opcode 9"):
        receiver.received(32)
