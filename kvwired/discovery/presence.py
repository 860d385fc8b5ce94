"""A daemon's part in the registry: a receiver announces, a sender watches.

The daemons hold one of these when ``discovery`` is set, and nothing of
etcd otherwise: the client (and gRPC with it) is imported only then.
"""

from __future__ import annotations

import asyncio
import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator

import structlog

from ..metrics import LiveSample
from ..tasks import TaskSet
from .address import RegistryAddress
from .membership import Changes, Member, Membership, RecordCheck

log = structlog.get_logger("kvwired.discovery")


class Presence(ABC):
    def __init__(self, url: str) -> None:
        from .registry import RegistryLink  # gRPC only where discovery is on

        self.address = RegistryAddress.parse(url)
        self.link = RegistryLink(self.address)
        self.tasks = TaskSet("registry")
        self._task: asyncio.Task[None] | None = None

    @abstractmethod
    def start(self) -> None:
        """Begin (announcing or watching) in the background."""

    def samples(self) -> Iterator[LiveSample]:
        yield ("kvwire_registry_up", "1 while the etcd registry answers (0: working from "
               "the membership last seen)", [], [], float(self.link.up))

    async def _stop_task(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None

    async def leave(self) -> None:
        """Stop taking part: no more announcing or watching (a receiver also
        takes its record out)."""
        await self._stop_task()

    async def close(self) -> None:
        await self.leave()
        await self.link.close()


class Announcement(Presence):
    """A receiver's record, kept fresh while it serves, withdrawn when it stops."""

    def __init__(self, url: str, describe: Callable[[], Member]) -> None:
        from .registry import Announcer

        super().__init__(url)
        self.announcer = Announcer(self.link, describe)
        self._withdrawal: asyncio.Future[None] | None = None

    def start(self) -> None:
        self._task = self.tasks.spawn(self.announcer.run(), "registry-announce")

    async def leave(self) -> None:
        """Stop refreshing and take the record out: senders stop choosing us now.
        Called again (a drain, then the stop), it waits for the first."""
        if self._withdrawal is None:
            self._withdrawal = asyncio.ensure_future(self._withdraw())
        await asyncio.shield(self._withdrawal)

    async def _withdraw(self) -> None:
        await super().leave()  # no refresh may re-create the record after this
        await self.announcer.withdraw()


class Subscription(Presence):
    """A sender's view of the receivers, handed to ``on_change`` as it changes."""

    def __init__(self, url: str, protocol: int,
                 on_change: Callable[[Changes], None],
                 check: RecordCheck | None = None) -> None:
        from .registry import Watcher

        super().__init__(url)
        self.membership = Membership(protocol, check)
        self.watcher = Watcher(self.link, self.membership, on_change)

    def start(self) -> None:
        self._task = self.tasks.spawn(self.watcher.run(), "registry-watch")

    def samples(self) -> Iterator[LiveSample]:
        yield from super().samples()
        yield ("kvwire_cluster_members", "receivers in the registry, as last seen", [], [],
               float(len(self.membership.members)))
