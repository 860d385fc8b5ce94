"""``OutgoingPush``: one request a prefill engine is pushing.

The engine fills each layer in staging memory and commits it; ``finish``
says how the request ended. The ``on_*`` methods and ``retire`` are the
client's side: ``SenderClient`` calls them as its daemon's messages arrive.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from ..errors import KvwireError, UsageError
from ..layout import RequestShape
from ..protocol import sender_local as prefill_api
from .connection import Connection
from .results import PushResult

# How long a push whose every layer was committed waits for its sender daemon
# to come back (systemd restarts it) and say how the request ended, when it
# has no deadline; with one, until the deadline and VERDICT_GRACE past it.
DAEMON_RETURN_WAIT = 30.0
VERDICT_GRACE = 2.0


class OutgoingPush:
    """One request being pushed: fill layers in staging memory, commit each."""

    def __init__(self, conn: Connection, req: str, shape: RequestShape, offset: int,
                 chunk_bytes: int, started: float, peer: str = "", lease: int = 0,
                 deadline: float | None = None) -> None:
        self._conn = conn
        self.req = req
        self.peer = peer  # the receiver it goes to (the sender's choice, for "auto")
        self.lease = lease  # the receiver's lease: what to ask about if the daemon dies
        self.deadline = deadline  # seconds from ``started``, as given to open()
        self.shape = shape
        self.chunk_bytes = chunk_bytes
        maps = conn.slot_maps
        assert maps is not None, "a sender connection maps its staging per push"
        # This push's own mapping of its staging: when it ends, the mapping is
        # taken from every view, so a view kept past the end can never write
        # into a later push that reuses the slot (see kvwired.slot_maps).
        self._maps = maps
        self._slot, self.buffer = maps.take(offset, shape.total_bytes)
        self._committed = 0
        self._aborted = False
        self._started = started
        self._result: asyncio.Future[PushResult] = asyncio.get_running_loop().create_future()
        self.sent_layers = 0  # layers placed at the receiver so far
        self._sent_changed = asyncio.Event()

    def layer(self, n: int) -> memoryview:
        """Writable staging memory of layer ``n`` (registered: no copy on the way out)."""
        self._check_open()  # an ended push's staging is gone: say why, typed
        offset, length = self.shape.layer_span(n)
        return self.buffer[offset : offset + length]

    def _check_open(self) -> None:
        if self._result.done():
            self._result.result()  # raises the failure, if that is what ended it
            raise UsageError(f"request {self.req} is already finished")

    def commit(self, n: int) -> None:
        """Hand layer ``n`` to the daemon; returns at once."""
        self._check_open()
        if n != self._committed:
            raise UsageError(f"layer {n} committed out of order",
                             hint=f"commit layers in order; layer {self._committed} is next")
        self._conn.send(prefill_api.Commit(req=self.req, layer=n))
        self._committed += 1

    async def wait_sent(self, n: int) -> None:
        """Wait until layer ``n`` is placed in the receiver's memory.

        Its staging memory may then be reused: an engine that double-buffers
        waits for layer n before computing layer n + 2 into the same buffer.
        """
        while self.sent_layers <= n:
            if self._result.done():
                self._result.result()  # a failure ends the wait
                return
            await self._sent_changed.wait()
            self._sent_changed.clear()

    def on_sent(self, layer: int) -> None:
        self.sent_layers = max(self.sent_layers, layer + 1)
        self._sent_changed.set()

    async def finish(self) -> PushResult:
        """Wait until the receiver has every byte; the request's timings."""
        if (self._committed < self.shape.layers and not self._aborted
                and not self._result.done()):
            raise UsageError(
                f"finish() before every layer was committed ({self._committed} of "
                f"{self.shape.layers})", hint="commit all layers, or abort()")
        # Shielded: a caller that stops waiting (asyncio.wait_for, a cancelled
        # task) must not cancel the outcome itself, or the push could neither
        # be aborted nor learn what the receiver decided.
        return await asyncio.shield(self._result)

    def abort(self) -> None:
        """Ask the daemon to abort; ``finish()`` then says how the request ended
        (aborted, or delivered first: the receiver decides)."""
        if not self._result.done() and not self._aborted:
            self._aborted = True
            # A broken connection fails the push with its own error.
            with contextlib.suppress(KvwireError):
                self._conn.send(prefill_api.Abort(req=self.req))

    def on_finished(self, msg: prefill_api.Finished) -> None:
        if not self._result.done():
            self._result.set_result(PushResult(
                self.req, self.shape.total_bytes, msg.checksum,
                time.perf_counter() - self._started, dict(msg.timings)))
        self.on_sent(self.shape.layers - 1)
        self.retire()

    def on_failed(self, error: KvwireError) -> None:
        if not self._result.done():
            self._result.set_exception(error)
            self._result.exception()  # mark retrieved: the caller may never finish()
        self._sent_changed.set()
        self.retire()

    @property
    def fully_committed(self) -> bool:
        """Every layer is in the daemon's hands: the receiver may have it all."""
        return self._committed == self.shape.layers

    def verdict_wait(self) -> float:
        """Seconds to wait for a lost daemon's successor to say how this ended."""
        if self.deadline is None:
            return DAEMON_RETURN_WAIT
        left = self._started + self.deadline - time.perf_counter()
        return max(0.0, left) + VERDICT_GRACE

    def retire(self, tell_daemon: bool = True) -> None:
        """The push ended: take its staging away from every view, then let the
        daemon reuse it."""
        if self._slot.mapping.closed:
            return
        self.buffer.release()
        self._maps.retire(self._slot)
        if tell_daemon and self._conn.broken is None:
            self._conn.send(prefill_api.Dropped(req=self.req))


