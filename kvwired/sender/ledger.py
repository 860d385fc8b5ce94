"""``PostLedger``: a link's posts not yet known placed, per data channel, so that
a replaced channel can post them again.

A data channel that fails (a queue pair out of retries, a stream reset) fails
every post still outstanding on it. Under a live control connection the link
replaces the channel rather than the whole connection (``DataChannels._replace``);
the posts it lost are then posted again, in their order, on the new channel
and under the leases' new keys. That is safe because a write into a lease is
idempotent (the same staging bytes to the same place: a layer's staging is
reused only once every write of it is placed), and a layer's immediate seen
twice is stale to the receiver's landing fence (kvwired.stripes), which
ignores it.

Whoever posted holds the *outer* future: it ends when the writes are placed
on some channel, or when the link gives up. Nothing here does I/O beyond
calling the channel's ``post``.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..errors import KvwireError
from ..transport.base import DataChannel, Write


@dataclass(eq=False)
class Posted:
    """One post: what to write again, and the future its poster waits on."""

    writes: Sequence[Write]
    imm: int | None
    lease: int
    outer: asyncio.Future[None]
    inner: asyncio.Future[None] | None = None  # on the channel it was last posted on


@dataclass
class PostLedger:
    """Posts outstanding per data channel, in the order they were posted."""

    lanes: list[deque[Posted]] = field(default_factory=list)
    # Channels being replaced: a post that fails on one waits to be posted again.
    replacing: set[int] = field(default_factory=set)

    def reset(self, channels: int) -> None:
        self.lanes = [deque() for _ in range(channels)]
        self.replacing.clear()

    def post(self, number: int, channel: DataChannel, writes: Sequence[Write],
             imm: int | None, lease: int, key: int) -> asyncio.Future[None]:
        outer: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        record = Posted(writes, imm, lease, outer)
        self.lanes[number].append(record)
        self._send(number, record, channel, key)
        return outer

    def _send(self, number: int, record: Posted, channel: DataChannel, key: int) -> None:
        inner = channel.post(record.writes, record.imm, key)
        record.inner = inner
        inner.add_done_callback(lambda done: self._settled(number, record, done))

    def _settled(self, number: int, record: Posted, inner: asyncio.Future[None]) -> None:
        # Read first, whatever follows: an inner future failed after its post
        # was posted again, or after the link ended the outer one, is read by
        # nobody else, and asyncio would log each as an exception never
        # retrieved (one line per pending write when a channel stalls).
        error = asyncio.CancelledError() if inner.cancelled() else inner.exception()
        if record.inner is not inner or record.outer.done():
            return  # posted again since, or ended by the link
        if isinstance(error, asyncio.CancelledError):
            self._end(number, record, error)
            return
        if error is None:
            self._end(number, record, None)
        elif number not in self.replacing:
            self._end(number, record, error)
        # else: the channel's replacement posts it again (``repost``)

    def _end(self, number: int, record: Posted, error: BaseException | None) -> None:
        lane = self.lanes[number] if number < len(self.lanes) else None
        if lane is not None and record in lane:
            lane.remove(record)
        if record.outer.done():
            return
        if error is None:
            record.outer.set_result(None)
        else:
            record.outer.set_exception(error)

    def repost(self, number: int, channel: DataChannel, keys: dict[int, int],
               wanted: Callable[[int], bool] = lambda lease: True,
               dropped: BaseException | None = None) -> int:
        """Post channel ``number``'s lost posts again on ``channel`` (its
        replacement), under ``keys`` (by lease: the receiver's new keys).

        A lease the receiver gave no key takes no writes any more: every
        layer of it landed (its key revoked) or it ended, which the control
        connection has already said, so its posts are done. A lease whose
        holder stopped posting (not ``wanted``: an abort drains) has its
        posts failed with ``dropped``, the old channel's error: they will
        never be placed, and only the drain waits for them. Returns how many
        immediates were posted (each takes one of the new channel's credits)."""
        self.replacing.discard(number)
        immediates = 0
        for record in list(self.lanes[number]):
            if record.outer.done():
                self.lanes[number].remove(record)
            elif record.lease not in keys:
                self._end(number, record, None)
            elif not wanted(record.lease):
                self._end(number, record, dropped)
            else:
                self._send(number, record, channel, keys[record.lease])
                immediates += record.imm is not None
        return immediates

    def fail_all(self, error: KvwireError) -> None:
        """The link is gone: every post outstanding fails with its error."""
        lanes, self.lanes = self.lanes, []
        self.replacing.clear()
        for lane in lanes:
            for record in lane:
                if not record.outer.done():
                    record.outer.set_exception(error)
