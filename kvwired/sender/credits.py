"""``Credits``: how many immediates a link may still post, per data channel.

The receiver keeps ``credits`` receives posted on each data channel and
says so in its ``welcome``; every immediate consumes one, and the receiver
hands them back (``credits``) as it reposts. A sender that posted an
immediate with no receive waiting would fail the channel (RNR), so a post
takes a credit first and waits while there is none.

A channel being replaced is frozen: what the receiver returns for it are
the old responder's receives, void with it. Its replacement starts with a
full set, less the immediates posted again on it (``thaw``).

I/O-free apart from the one event a waiting poster sleeps on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ..errors import KvwireError


class Credits:
    """Per data channel: the immediates that may still be posted there."""

    def __init__(self) -> None:
        self.counts: list[int] = []
        self._frozen: set[int] = set()
        self._freed = asyncio.Event()

    def reset(self, channels: int, each: int) -> None:
        """A new set of channels, each with ``each`` credits (the welcome's)."""
        self.counts = [each] * channels
        self._frozen.clear()
        self.wake()

    def clear(self) -> None:
        """No channels: whoever waits wakes to find the link gone."""
        self.counts = []
        self._frozen.clear()
        self.wake()

    def add(self, n: int, channel: int) -> None:
        if channel < len(self.counts) and channel not in self._frozen:
            self.counts[channel] += n
        self.wake()

    def freeze(self, channel: int) -> None:
        """Channel ``channel`` is being replaced: nothing may be posted on it,
        and credits returned for its old receives do not count."""
        self._frozen.add(channel)
        self.counts[channel] = 0

    def thaw(self, channel: int, n: int) -> None:
        """The replacement of ``channel`` is up with ``n`` credits."""
        self._frozen.discard(channel)
        self.counts[channel] = max(0, n)
        self.wake()

    def wake(self) -> None:
        """Let every waiting poster look again (credits, or the link's end)."""
        self._freed.set()

    @property
    def total(self) -> int:
        return sum(self.counts)

    async def take(self, channel: int, usable: Callable[[], bool],
                   gone: Callable[[], KvwireError]) -> None:
        """Take one credit of ``channel``, waiting for one while the link is
        ``usable``; raise ``gone()`` once it is not."""
        while not usable() or self.counts[channel] <= 0:
            if not usable():
                raise gone()
            event = self._freed
            await event.wait()
            if event is self._freed:
                self._freed = asyncio.Event()
        self.counts[channel] -= 1
