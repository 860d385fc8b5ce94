"""The one way tests wait: for a condition, polled, never for a fixed time.

``until`` (in a test's event loop) and ``wait_until`` (in plain code) poll a
condition until it holds or the timeout passes; both return the seconds it
took, so a test can say how long something took without asserting on it. A
condition may be a coroutine function (``until``), and may raise one of
``ignoring`` while the thing it looks at is not up yet (a port, a file).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

Condition = Callable[[], "bool | Awaitable[bool]"]


async def until(condition: Condition, timeout: float = 10.0, what: str = "condition",
                every: float = 0.01,
                ignoring: tuple[type[BaseException], ...] = ()) -> float:
    """Wait in the running loop for ``condition``; the seconds it took."""
    started = time.monotonic()
    while not await _holds(condition, ignoring):
        assert time.monotonic() - started < timeout, f"{what} not reached within {timeout:g} s"
        await asyncio.sleep(every)
    return time.monotonic() - started


def wait_until(condition: Callable[[], bool], timeout: float = 30.0,
               what: str = "condition", every: float = 0.05,
               ignoring: tuple[type[BaseException], ...] = ()) -> float:
    """Wait (blocking) for ``condition``; the seconds it took."""
    started = time.monotonic()
    while True:
        try:
            if condition():
                return time.monotonic() - started
        except ignoring:
            pass
        assert time.monotonic() - started < timeout, f"{what} not reached within {timeout:g} s"
        time.sleep(every)


async def _holds(condition: Condition, ignoring: tuple[type[BaseException], ...]) -> bool:
    try:
        result = condition()
        if inspect.isawaitable(result):
            result = await result
        return bool(result)
    except ignoring:
        return False
