"""``SendQueue``: which writes go on a queue pair's send queue next, which of
them are signalled, and what each completion frees. No I/O: the channel
carries each burst out with the ``wr_*`` calls, and feeds completions back.

A queue pair's send queue holds ``depth`` work requests, and only a
signalled one produces a completion, which frees it and every unsignalled
one posted before it. So the queue signals:

- each post's last write, whose completion ends that post;
- every ``signal_every``-th write, so a long post frees room as it goes;
- the last write of a burst cut short by a full queue, so that no posted
  work request waits for a completion that would come only with more posts.

The count each signal frees is kept with it; ``outstanding`` is their sum,
and never more than ``depth``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from ..base import Write

SQ_DEPTH = 1024
SIGNAL_EVERY = SQ_DEPTH // 4

T = TypeVar("T")  # what a post's poster waits on (its future)


@dataclass(eq=False)
class Post(Generic[T]):
    writes: Sequence[Write]
    imm: int | None
    key: int
    done: T
    next: int = 0  # its first write not yet on the send queue


@dataclass
class Signal(Generic[T]):
    wr_id: int
    count: int  # work requests this completion accounts for
    done: T | None  # the post it ends, if it is that post's last write


@dataclass
class Burst(Generic[T]):
    """Writes ``start`` to ``end`` (exclusive) of ``post``, to go on the queue
    at once; ``signalled`` maps the index of each signalled one to its wr_id."""

    post: Post[T]
    start: int
    end: int
    signalled: dict[int, int] = field(default_factory=dict)

    @property
    def last_of_post(self) -> int:
        return len(self.post.writes) - 1


class SendQueue(Generic[T]):
    """The accounting of one queue pair's send queue."""

    def __init__(self, depth: int = SQ_DEPTH, signal_every: int = SIGNAL_EVERY) -> None:
        self.depth = depth
        self.signal_every = signal_every
        self.outstanding = 0  # on the send queue, not yet freed by a completion
        self._waiting: deque[Post[T]] = deque()  # posts with writes not yet on it
        self._signals: deque[Signal[T]] = deque()
        self._next_wr_id = 1

    def add(self, post: Post[T]) -> None:
        self._waiting.append(post)

    @property
    def pending_writes(self) -> int:
        """Writes posted and not yet known placed (waiting ones included)."""
        return self.outstanding + sum(len(p.writes) - p.next for p in self._waiting)

    def next_burst(self) -> Burst[T] | None:
        """The next writes that fit on the send queue, or None if none do."""
        if not self._waiting or self.outstanding >= self.depth:
            return None
        post = self._waiting[0]
        start = post.next
        end = min(len(post.writes), start + self.depth - self.outstanding)
        last = len(post.writes) - 1
        burst = Burst(post, start, end)
        wr_id = self._next_wr_id
        since = 0  # a burst's last write is always signalled: none carries over
        for i in range(start, end):
            since += 1
            if i == last or i == end - 1 or since >= self.signal_every:
                burst.signalled[i] = wr_id
                wr_id += 1
                since = 0
        return burst

    def posted(self, burst: Burst[T]) -> None:
        """``burst`` is on the send queue (``wr_complete`` returned)."""
        post, previous = burst.post, burst.start - 1
        for index, wr_id in burst.signalled.items():
            self._signals.append(Signal(wr_id, index - previous,
                                        post.done if index == burst.last_of_post else None))
            previous = index
        self._next_wr_id += len(burst.signalled)
        self.outstanding += burst.end - burst.start
        post.next = burst.end
        if burst.end == len(post.writes):
            self._waiting.popleft()

    def completed(self, wr_id: int) -> list[T]:
        """Signalled work request ``wr_id`` completed: it and every one before
        it are placed. The posts that ended with them, in order."""
        ended: list[T] = []
        while self._signals:
            signal = self._signals.popleft()
            self.outstanding -= signal.count
            if signal.done is not None:
                ended.append(signal.done)
            if signal.wr_id == wr_id:
                break
        return ended

    def take_outstanding(self) -> list[T]:
        """Forget everything (the queue pair failed): what each post waited on."""
        ended = [s.done for s in self._signals if s.done is not None]
        ended += [p.done for p in self._waiting]
        self._signals.clear()
        self._waiting.clear()
        self.outstanding = 0
        return ended
