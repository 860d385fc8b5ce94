"""Background tasks that are neither lost to the garbage collector nor silent.

asyncio keeps only a weak reference to a task: one nobody holds can vanish
mid-flight, and an exception in one nobody awaits is only reported when it
is collected. ``spawn`` holds the task until it ends and logs a crash at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import structlog

log = structlog.get_logger("kvwired.tasks")
T = TypeVar("T")
_running: set[asyncio.Task[Any]] = set()


def spawn(coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
    task = asyncio.create_task(coro, name=name)
    _running.add(task)
    task.add_done_callback(_finished)
    return task


def _finished(task: asyncio.Task[Any]) -> None:
    _running.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.error("background task crashed", task=task.get_name(),
                  exc_info=task.exception())
