"""A hung test ends as a failure that says what it was waiting on.

pytest-timeout ends a test that runs past its limit (``timeout`` in
pyproject.toml, or a test's own ``@pytest.mark.timeout``) and prints every
thread's stack. A hung asyncio test's thread is always in the event loop's
``select()``, which says nothing: what waits is a task. So shortly before
the limit, each running event loop's tasks are printed with their stacks
too. Without this, one hang used the whole CI run's time and left a log
that ended in the name of a test file.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
from typing import Any, TextIO

import pytest

# Printed this long before the limit, so that the tasks are seen while they
# still wait (pytest-timeout's failure then unwinds them).
AHEAD_S = 5.0
_TIMER = pytest.StashKey[threading.Timer]()


def running_loops() -> list[asyncio.AbstractEventLoop]:
    """Every event loop running now, in any thread."""
    return [found for found in gc.get_objects()
            if isinstance(found, asyncio.AbstractEventLoop) and found.is_running()]


def print_tasks(out: TextIO = sys.stderr, title: str = "") -> int:
    """Each running loop's unfinished tasks, with where each one waits; how many."""
    count = 0
    for loop in running_loops():
        for task in asyncio.all_tasks(loop):
            count += 1
            print(f"\n--- {title}task {task.get_name()}: {task!r}", file=out)
            task.print_stack(file=out)
    out.flush()
    return count


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> None:
    if settings.timeout and settings.timeout > AHEAD_S:
        timer = threading.Timer(settings.timeout - AHEAD_S, print_tasks,
                                kwargs={"title": f"{item.nodeid} near its timeout: "})
        timer.daemon = True
        timer.start()
        item.stash[_TIMER] = timer
    # None: pytest-timeout's own implementation still sets its timer.


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_cancel_timer(item: pytest.Item) -> None:
    timer = item.stash.get(_TIMER, None)
    if timer is not None:
        timer.cancel()
