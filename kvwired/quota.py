"""How much of the receive pool each sender may hold at once.

A sender over its quota waits, like a request waits for pool room, and
after ``lease_wait`` gets ``PoolFull`` naming its quota: the other senders'
requests are not held up by it. Quotas count request bytes by sender name,
which authentication binds to a certificate, so a sender cannot spread its
requests over made-up names.
"""

from __future__ import annotations

import asyncio
import contextlib

from .errors import PoolFull, RequestTooLarge
from .units import format_size


class SenderQuotas:
    """``limit`` bytes per sender; None (a quota of the whole pool) only counts.
    A reload may change the limit: what senders hold stays counted."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.held: dict[str, int] = {}
        self._freed = asyncio.Event()

    async def take(self, sender: str, length: int, wait: float) -> None:
        """Count ``length`` bytes against ``sender``, waiting up to ``wait`` s for room."""
        if self.limit is None:
            self.held[sender] = self.held.get(sender, 0) + length
            return
        if length > self.limit:
            raise RequestTooLarge(
                f"a request of {format_size(length)} is over the per-sender quota of "
                f"{format_size(self.limit)}", hint="raise sender_quota on the receiver")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        limit = self.limit
        while self.held.get(sender, 0) + length > limit:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise PoolFull(
                    f"sender {sender} holds {format_size(self.held.get(sender, 0))} of its "
                    f"{format_size(limit)} quota of this receiver's pool",
                    hint="its decode engines must release delivered requests; or raise "
                         "sender_quota")
            freed = self._freed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(freed.wait(), remaining)
        self.held[sender] = self.held.get(sender, 0) + length

    def give_back(self, sender: str, length: int) -> None:
        left = self.held.get(sender, 0) - length
        if left > 0:
            self.held[sender] = left
        else:
            self.held.pop(sender, None)
        self._freed.set()
        self._freed = asyncio.Event()
