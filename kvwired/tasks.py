"""Background tasks, each held by the owner that started it.

asyncio keeps only a weak reference to a task: one nobody holds can vanish
mid-flight, and an exception in one nobody awaits is only reported when it
is collected. A ``TaskSet`` holds its owner's tasks until they end, logs a
crash at once, and cancels what is still running when the owner ends (a
session, a link, a daemon): nothing an ended owner started runs on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import structlog

log = structlog.get_logger("kvwired.tasks")
T = TypeVar("T")


class TaskSet:
    """The tasks one owner started and has not seen end."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._running: set[asyncio.Task[Any]] = set()
        self.cancelled = False

    def spawn(self, coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
        """Run ``coro`` as a task of this owner; one started after the owner
        ended is cancelled before it runs (it closes without a step)."""
        task = asyncio.create_task(coro, name=name)
        if self.cancelled:
            task.cancel()
        self._running.add(task)
        task.add_done_callback(self._finished)
        return task

    def __len__(self) -> int:
        return len(self._running)

    def cancel(self) -> None:
        """The owner ended: cancel what it started and is still running."""
        self.cancelled = True
        for task in list(self._running):
            task.cancel()

    async def close(self) -> None:
        """Cancel, and wait until every task has ended."""
        self.cancel()
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self._running.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task crashed", owner=self.owner, task=task.get_name(),
                      exc_info=task.exception())
