"""Per-lease keys on a responder's queue pair: memory windows, or an MR per lease.

A key reaches one lease's bytes, from one queue pair, while the lease takes
writes. Where the device bounds type 2 memory windows as the spec says (a
hardware RNIC), a window is bound over the lease and invalidated on revoke,
both work requests on the queue pair's send queue. rdma_rxe checks a write
through a window against the MR under it, so on a software device each
lease gets an MR of its own in the queue pair's own protection domain.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from ...errors import TransportError
from . import core
from .core import VerbsError
from .queue_pair import QueuePair

# One work request, posted signalled on a queue pair under the wr_id given.
SendWork = Callable[[core.QueuePair, int], None]
# Posts ``work`` on the responder's send queue; ``done`` hears how it ended,
# and ``what`` names it in an error.
PostSend = Callable[[SendWork, Callable[[Exception | None], None], str], None]


class Window:
    """A type 2 memory window: bound to one lease's bytes on one QP at a time."""

    # The key's low byte is ours to change: a new one for every binding, so
    # a key revoked before is refused even by the window bound again. After
    # 255 bindings the byte would come round to an old key: the window is
    # retired instead, and a new one (a new index) takes its place.
    MAX_BINDINGS = 255

    def __init__(self, pd: core.ProtectionDomain) -> None:
        try:
            self.mw = core.MemoryWindow(pd)
        except VerbsError as exc:
            raise TransportError(f"allocating a memory window failed: {exc}") from exc
        self.rkey = self.mw.rkey
        self.bindings = 0

    def next_key(self) -> int:
        self.bindings += 1
        self.rkey = (self.rkey & ~0xFF) | ((self.rkey + 1) & 0xFF)
        return self.rkey

    @property
    def worn_out(self) -> bool:
        return self.bindings >= self.MAX_BINDINGS


class LeaseKeys:
    """The keys one responder granted, and their revocation."""

    def __init__(self, post_send: PostSend) -> None:
        self._post_send = post_send
        self._windows: dict[int, Window] = {}  # bound, by key
        self._spare: list[Window] = []  # invalidated, to bind again
        # Software devices: an MR per lease, by key.
        self._lease_mrs: dict[int, core.MemoryRegion] = {}
        self._used_keys: set[int] = set()

    async def grant(self, qp: QueuePair, offset: int, length: int) -> int:
        if not qp.device.bounds_windows:
            return self._register_lease(qp, offset, length)
        window = self._spare.pop() if self._spare else Window(qp.device.pd)
        key = window.next_key()
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        mr, address = qp.device.mr, qp.device.base + offset
        self._post_send(lambda q, wr_id: q.bind_window(window.mw, key, mr, address, length,
                                                       core.IBV_ACCESS_REMOTE_WRITE, wr_id),
                        lambda error: settle(done, error), "binding a memory window")
        await done
        self._windows[key] = window
        return key

    def _register_lease(self, qp: QueuePair, offset: int, length: int) -> int:
        """A software device's lease: an MR of its own in this QP's own PD, so
        its key reaches these bytes, from this QP, and nothing else. A key
        this session used before is never handed out again (rxe draws the
        key byte at random, and an index comes back once freed)."""
        for _ in range(16):
            try:
                mr = core.MemoryRegion(qp.pd, qp.device.base + offset, length,
                                       core.IBV_ACCESS_LOCAL_WRITE | core.IBV_ACCESS_REMOTE_WRITE)
            except VerbsError as exc:
                raise TransportError(f"registering a lease's {length} B failed: {exc}",
                                     hint="check the locked-memory limit") from exc
            key = mr.rkey
            if key not in self._used_keys:
                self._used_keys.add(key)
                self._lease_mrs[key] = mr
                return key
            with contextlib.suppress(VerbsError):
                mr.close()
        raise TransportError("no fresh remote key after 16 registrations")

    def revoke(self, key: int, then: Callable[[], None], qp_gone: bool) -> None:
        lease_mr = self._lease_mrs.pop(key, None)
        if lease_mr is not None:
            # Deregistered: the RNIC refuses the key from now on, in flight or not.
            with contextlib.suppress(VerbsError):
                lease_mr.close()
            then()
            return
        window = self._windows.pop(key, None)
        if window is None or qp_gone:
            then()  # never bound, or its QP is gone: no write can use it
            return

        def invalidated(error: Exception | None) -> None:
            if error is None and not window.worn_out:
                self._spare.append(window)
            elif error is None:
                with contextlib.suppress(VerbsError):
                    window.mw.close()
            then()  # on an error the QP is torn down: no write can land either
        self._post_send(lambda q, wr_id: q.invalidate(key, wr_id), invalidated,
                        "invalidating a memory window")

    def close(self) -> None:
        """The QP is gone, so no window bound to it answers any more."""
        for window in [*self._windows.values(), *self._spare]:
            with contextlib.suppress(VerbsError):
                window.mw.close()
        for lease_mr in self._lease_mrs.values():
            with contextlib.suppress(VerbsError):
                lease_mr.close()
        self._windows.clear()
        self._spare.clear()
        self._lease_mrs.clear()


def settle(future: asyncio.Future[None], error: Exception | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
