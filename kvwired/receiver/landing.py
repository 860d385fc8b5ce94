"""The data path's end: immediates in, layers announced, the checksum made.

Each immediate names a lease and a layer (kvwired.immediate). A layer has
landed once every data channel the lease was granted on has reported its
part (kvwired.stripes); the engines are told at once, and the layer is
hashed beside the loop while later layers are still on the wire, so only
the last one is left for the end (kvwired.checksum).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import structlog

from .. import checksum
from ..lifecycle.lease import LeaseEvent, LeaseState
from ..metrics import Metrics
from ..pool import Pool
from ..tasks import TaskSet
from .leases import Lease, LeaseBook, LeaseWatchers
from .session import SenderSession

log = structlog.get_logger("kvwired.receiver")

HASH_THREADS = 2


class Landing:
    """Where the request path's immediates go."""

    def __init__(self, book: LeaseBook, watchers: LeaseWatchers, metrics: Metrics,
                 pool: Callable[[], Pool]) -> None:
        self.book = book
        self.watchers = watchers
        self.metrics = metrics
        self._pool = pool
        # XXH3 releases the GIL, so the loop keeps receiving while layers are
        # hashed. Two threads, so that a request whose layers all land at once
        # (one write) is hashed in half the time.
        self._hasher = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="kvwire-hash")
        self.tasks = TaskSet("landing")  # each request's last step: its checksum

    async def close(self) -> None:
        """No hash may still be reading the pool once it can be unmapped."""
        await self.tasks.close()
        await asyncio.to_thread(self._hasher.shutdown)

    def on_immediate(self, session: SenderSession, channel: int, lease_id: int,
                     layer: int) -> None:
        session.return_credits(1, channel)
        lease = self.book.leases.get(lease_id)
        if (lease is None or lease.session is not session
                or lease.state is not LeaseState.FILLING
                or (landed := lease.fence.report(channel, layer)) is None):
            self.metrics.stale_immediates.inc()
            log.debug("stale immediate dropped", lease=lease_id, layer=layer, channel=channel)
            return
        if not landed:
            return  # other channels still place their part of the layer
        memory = self._pool().memory.view
        loop = asyncio.get_running_loop()
        for n in landed:
            self.watchers.notify(lease.req, lease.layer_message(n))
            offset, length = lease.shape.layer_span(n)
            start = lease.slot.offset + offset
            view = memory[start : start + length]
            if n < lease.shape.layers - 1:
                lease.digests.append(loop.run_in_executor(self._hasher, checksum.of_layer, view))
            else:
                # The last layer: hashed here, at once, rather than after a
                # hop to a worker and back (1 ms of the 1.3 ms measured).
                last: asyncio.Future[int] = loop.create_future()
                last.set_result(checksum.of_layer(view))
                lease.digests.append(last)
        self.metrics.bytes.labels(session.label, "received").inc(
            len(landed) * lease.shape.layer_bytes)
        if lease.landed == lease.shape.layers:
            self.book.event(lease, LeaseEvent.ALL_LANDED)
            self.tasks.spawn(self.complete(lease), f"complete-{lease.req}")

    async def complete(self, lease: Lease) -> None:
        digests = await asyncio.gather(*lease.digests)
        if self.book.leases.get(lease.id) is not lease or lease.state is not LeaseState.LANDED:
            return  # aborted while its last layers were being hashed
        lease.checksum = checksum.combine(digests)
        elapsed = asyncio.get_running_loop().time() - lease.opened_at
        self.metrics.requests.labels(lease.session.label, "delivered").inc()
        self.metrics.request_seconds.labels(lease.session.label).observe(elapsed)
        # Nobody consumes an experiment's request: it is freed at once.
        self.book.event(lease, LeaseEvent.CHECKED_DISCARD if lease.discard
                        else LeaseEvent.CHECKED)
        log.info("request delivered", req=lease.req, sender=lease.session.name,
                 bytes=lease.shape.total_bytes, seconds=round(elapsed, 6))
        if lease.machine.state is LeaseState.HELD:
            self.watchers.delivered(lease)


def count_received(session: SenderSession, metrics: Metrics) -> None:
    """Writes as the transport saw them, once per immediate rather than per
    write: every write over TCP, only the immediates over verbs (the rest
    never involve the receiver's CPU)."""
    if not session.responders:
        return
    writes = session.writes_received - session.writes_counted
    session.writes_counted += writes
    metrics.writes.labels(session.label, "received", "write_imm").inc()
    if writes > 1:
        metrics.writes.labels(session.label, "received", "write").inc(writes - 1)

