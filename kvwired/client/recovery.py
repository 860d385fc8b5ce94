"""Restart recovery: a sender daemon that went away with pushes fully committed.

Such a push may have been delivered before the daemon went. Rather than
guess, and split the outcome with the decode engine, the client reaches the
daemon that systemd starts again at the same socket and asks it (``ask``:
its link asks the receiver, kvwired.verdicts).
"""

from __future__ import annotations

import asyncio
import contextlib

from ..errors import KvwireError, from_wire
from ..protocol import SENDER_LOCAL, Failed, Message
from ..protocol import sender_local as prefill_api
from .connection import Connection
from .push import OutgoingPush

RECONNECT_EVERY = 0.2  # seconds between attempts to reach a restarted daemon


async def ask_successor(path: str, pushes: list[OutgoingPush], error: KvwireError) -> None:
    """Reach the restarted daemon at the same socket and ask how each push
    ended; one not answered within its ``verdict_wait`` fails with ``error``."""
    loop = asyncio.get_running_loop()
    waiting = {push.req: push for push in pushes}
    answered = asyncio.Event()

    def give_up(push: OutgoingPush) -> None:
        if waiting.pop(push.req, None) is not None:
            push.on_failed(error)
        if not waiting:
            answered.set()

    def route(msg: Message) -> None:
        push = waiting.pop(getattr(msg, "req", ""), None)
        if push is None:
            return
        if isinstance(msg, prefill_api.Finished):
            push.on_finished(msg)
        elif isinstance(msg, Failed):
            push.on_failed(from_wire(msg.error))
        if not waiting:
            answered.set()

    for push in pushes:
        push.retire(tell_daemon=False)  # the daemon that shared that staging is gone
        loop.call_later(push.verdict_wait(), give_up, push)
    while waiting:
        conn = Connection(path, "prefill", SENDER_LOCAL, route,
                           lambda _: answered.set())
        try:
            await conn.open(map_pool=False)
        except (KvwireError, OSError):
            # Not back yet: systemd restarts it; try again shortly.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(answered.wait(), RECONNECT_EVERY)
            continue
        try:
            for push in waiting.values():
                conn.send(prefill_api.Ask(req=push.req, peer=push.peer, lease=push.lease))
            await answered.wait()
        except KvwireError:
            pass  # it went away again: the loop reconnects
        finally:
            answered.clear()
            await conn.close()

