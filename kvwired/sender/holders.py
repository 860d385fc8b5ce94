"""``Holders``: the leases held on one link, who holds each, and its keys.

A link knows nothing of what holds a lease (a push, an experiment's echo
lease): holders register themselves (``kvwired.ports.LeaseHolder``), and
the link routes the receiver's word on a lease (delivered, aborted, its
abort acknowledged) to whoever holds it. A lease that no holder has any
more has already ended on this side, so its news is dropped.

Each lease's keys, one per data channel, are the list its holder posts
with, changed in place when a replaced channel brings new ones.

A lease whose abort we sent is owed an answer. A receiver that stays
silent on it has stopped following the protocol, and only the end of the
link voids the lease on its side: the link is lost (the third of the three
places that may decide so: docs/DESIGN.md, "How the daemons' parts meet").
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ..errors import KvwireError
from ..ports import LeaseHolder


class Holders:
    """The leases held on one link."""

    def __init__(self, lost: Callable[[KvwireError], None]) -> None:
        self._lost = lost  # the link's: it is down
        self._holders: dict[int, LeaseHolder] = {}
        self._owed: dict[int, asyncio.TimerHandle] = {}  # leases owed an answer
        self._keys: dict[int, list[int]] = {}
        self._unheld = asyncio.Event()  # set while no lease is held
        self._unheld.set()

    def __bool__(self) -> bool:
        return bool(self._holders)

    def attach(self, lease: int, holder: LeaseHolder, keys: list[int] | None = None) -> None:
        self._holders[lease] = holder
        self._unheld.clear()
        if keys is not None:
            self._keys[lease] = keys

    def detach(self, lease: int) -> None:
        self._answered(lease)
        self._holders.pop(lease, None)
        self._keys.pop(lease, None)
        if not self._holders:
            self._unheld.set()

    async def unheld(self) -> None:
        """Wait until no lease is held (a retiring link's last ends)."""
        await self._unheld.wait()

    def keys(self, lease: int) -> list[int] | None:
        """``lease``'s keys, one per data channel; None if it is not held."""
        return self._keys.get(lease)

    def rekey(self, channel: int, keys: dict[int, int]) -> None:
        """A replaced ``channel`` came with new keys, by lease."""
        for lease, key in keys.items():
            if (held := self._keys.get(lease)) is not None:
                held[channel] = key

    def takes_writes(self, lease: int) -> bool:
        """Whether ``lease``'s holder still posts (its lost writes go again)."""
        holder = self._holders.get(lease)
        return holder is not None and holder.takes_writes

    def owe_answer(self, lease: int, within: float, silence: KvwireError) -> None:
        """The receiver must say something of ``lease`` (delivered, aborted,
        its abort acknowledged) within ``within`` seconds, or the link is
        lost with ``silence``."""
        self._answered(lease)
        self._owed[lease] = asyncio.get_running_loop().call_later(
            within, self._silent, lease, silence)

    def _silent(self, lease: int, silence: KvwireError) -> None:
        del self._owed[lease]
        self._lost(silence)

    def _answered(self, lease: int) -> None:
        if (timer := self._owed.pop(lease, None)) is not None:
            timer.cancel()

    def delivered(self, lease: int, checksum: int) -> None:
        self._answered(lease)
        if (holder := self._holders.get(lease)) is not None:
            holder.delivered(checksum)

    def aborted(self, lease: int, error: KvwireError) -> None:
        self._answered(lease)
        if (holder := self._holders.get(lease)) is not None:
            holder.fail(error, by_receiver=True)

    def abort_acked(self, lease: int) -> None:
        self._answered(lease)
        if (holder := self._holders.get(lease)) is not None:
            holder.abort_acked()

    def fail_all(self, error: KvwireError) -> None:
        """The link went down: every holder fails with what broke it."""
        for lease in list(self._owed):
            self._answered(lease)
        for holder in list(self._holders.values()):
            holder.fail(error)
