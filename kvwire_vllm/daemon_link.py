"""An engine's connection to its node's daemon, made again after a restart.

The prefill side keeps one to its sender daemon, the decode side one to its
receiver daemon. systemd restarts a daemon that dies; the next push or load
then connects anew instead of failing on the dead connection for good.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from kvwired.client import ReceiverClient, SenderClient

C = TypeVar("C", bound=SenderClient | ReceiverClient)


class DaemonLink(Generic[C]):
    def __init__(self, connect: Callable[[], Awaitable[C]]) -> None:
        self._connect = connect
        self._client: C | None = None
        self._connecting = asyncio.Lock()  # one connect at a time (on the loop's thread)

    async def client(self) -> C:
        """The live connection, connected (again) if there is none."""
        async with self._connecting:
            if self._client is None or self._client.broken is not None:
                await self.close()
                self._client = await self._connect()
            return self._client

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.close()
