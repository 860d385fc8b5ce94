"""One request on its way out: ``Push``, and the ``PushDriver`` that moves it.

The driver reserves staging and a lease, then turns each committed layer
into one post of writes (the last carrying the immediate that announces the
layer), and ends the push exactly once: delivered with the receiver's
checksum, or failed with a typed error after no posted write can still read
its staging. Whoever opened the push hears the end through ``Push.outcome``
and the layers placed through ``on_sent``; the driver does not know whether
that is an engine on the unix socket or an experiment.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from .. import immediate
from ..config import SenderConfig
from ..errors import (
    DeadlineExceeded,
    DuplicateRequest,
    KvwireError,
    PeerLost,
    TransportError,
    UsageError,
    internal_error,
)
from ..layout import ChunkCursor, RequestShape
from ..metrics import Metrics
from ..pool import Pool, Slot
from ..protocol import message
from ..tasks import spawn
from ..transport.base import Write
from .link import PeerLink

log = structlog.get_logger("kvwired.sender")

Timings = dict[str, float]


@dataclass(eq=False)
class Push:
    """One request from open to its one outcome: what it holds and how far it got."""

    req: str
    link: PeerLink
    shape: RequestShape
    chunk_bytes: int
    staging: Slot
    lease: int
    remote_offset: int
    opened_at: float
    granted_at: float
    driver: PushDriver
    deadline: float | None = None  # time.monotonic() at which it fails
    # Layers up to n are placed remotely: the engine may reuse their staging.
    on_sent: Callable[[int], None] | None = None
    outcome: asyncio.Future[Delivery] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())
    commits: asyncio.Queue[int] = field(default_factory=asyncio.Queue)
    posts: list[asyncio.Future[None]] = field(default_factory=list)
    confirmed: asyncio.Future[int] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())
    error: KvwireError | None = None
    aborted_by_receiver: bool = False
    post_seconds: float = 0.0
    first_commit_at: float = 0.0
    last_commit_at: float = 0.0
    writes: int = 0
    task: asyncio.Task[None] | None = None

    def commit(self, layer: int) -> None:
        if self.first_commit_at == 0.0:
            self.first_commit_at = time.monotonic()
        self.commits.put_nowait(layer)

    def abort(self, error: KvwireError) -> None:
        self.driver.fail(self, error)

    # The link's LeaseHolder side.
    def delivered(self, checksum: int) -> None:
        if not self.confirmed.done():
            self.confirmed.set_result(checksum)

    def fail(self, error: KvwireError, *, by_receiver: bool = False) -> None:
        self.aborted_by_receiver = self.aborted_by_receiver or by_receiver
        self.driver.fail(self, error)


@dataclass(frozen=True)
class Delivery:
    """A push's good end: the receiver's checksum of every byte, and the timings."""

    checksum: int
    timings: Timings


class PushDriver:
    """Every push of one sender daemon, from open to its one outcome."""

    def __init__(self, config: SenderConfig, staging: Pool, metrics: Metrics) -> None:
        self.config = config
        self.staging = staging
        self.metrics = metrics
        self.pushes: dict[str, Push] = {}

    def update_pool_metrics(self) -> None:
        self.metrics.set_pool("staging", self.staging.size, self.staging.used_bytes)
        self.metrics.inflight.set(len(self.pushes))

    async def open(self, req: str, link: PeerLink, shape: RequestShape, chunk_bytes: int,
                   deadline: float | None = None, discard: bool = False) -> Push:
        """Staging and a lease for ``req``; the push is driven from then on.

        Raises a ``KvwireError`` (``DeadlineExceeded`` when ``deadline``
        seconds pass first); nothing is held then.
        """
        opened_at = time.monotonic()
        try:
            async with asyncio.timeout(deadline):
                push = await self._reserve(req, link, shape, chunk_bytes, discard, opened_at)
        except TimeoutError:
            raise DeadlineExceeded(
                f"request {req} could not be opened within its {deadline:g} s deadline",
                hint="raise the deadline, or check the receiver's pool and the link") from None
        if deadline is not None:
            push.deadline = opened_at + deadline
        self.pushes[req] = push
        link.attach(push.lease, push)
        self.update_pool_metrics()
        push.task = spawn(self._drive(push), f"push-{req}")
        return push

    async def _reserve(self, req: str, link: PeerLink, shape: RequestShape, chunk_bytes: int,
                       discard: bool, opened_at: float) -> Push:
        if req in self.pushes:
            raise DuplicateRequest(f"request {req} is already being pushed",
                                   hint="request ids must be unique among pushes in flight")
        if shape.layers > immediate.MAX_LAYERS:
            raise UsageError(f"request {req} has {shape.layers} layers; at most "
                             f"{immediate.MAX_LAYERS} are supported")
        if chunk_bytes < 1:
            raise UsageError(f"chunk size {chunk_bytes} B is not positive")
        staging = await self.staging.reserve(shape.total_bytes, self.config.staging_wait)
        self.update_pool_metrics()
        try:
            await link.ensure()
            lease = await link.open(req, shape, discard)
        except BaseException:
            self.staging.release(staging)
            self.update_pool_metrics()
            raise
        return Push(req, link, shape, chunk_bytes, staging, lease["lease"], lease["offset"],
                    opened_at, time.monotonic(), self)

    # ----------------------------------------------------------- data path

    async def _drive(self, push: Push) -> None:
        link = push.link
        cursor = ChunkCursor(push.shape, push.chunk_bytes)
        peer_bytes = self.metrics.bytes.labels(link.name, "sent")
        plain_writes = self.metrics.writes.labels(link.name, "sent", "write")
        imm_writes = self.metrics.writes.labels(link.name, "sent", "write_imm")
        sizes = self.metrics.write_sizes
        try:
            async with asyncio.timeout_at(self._loop_deadline(push)):
                while not cursor.done:
                    layer = await push.commits.get()
                    batch = cursor.commit(layer)
                    if batch is None:
                        continue
                    await link.take_credit()
                    channel = link.channel
                    if channel is None:
                        raise PeerLost(f"receiver {link.name} went away")
                    started = time.perf_counter()
                    base_local, base_remote = push.staging.offset, push.remote_offset
                    writes = [Write(base_local + c.offset, base_remote + c.offset, c.length)
                              for c in batch.chunks]
                    posted = channel.post(
                        writes, immediate.pack(push.lease, batch.completes_layer))
                    posted.add_done_callback(self._sent_callback(push, batch.completes_layer))
                    push.posts.append(posted)
                    push.post_seconds += time.perf_counter() - started
                    push.writes += len(writes)
                    plain_writes.inc(len(writes) - 1)
                    imm_writes.inc()
                    peer_bytes.inc(sum(c.length for c in batch.chunks))
                    # Chunks of a batch are one size but for a layer's tail.
                    first, last = batch.chunks[0].length, batch.chunks[-1].length
                    sizes.observe(link.name, first, len(batch.chunks) - 1)
                    sizes.observe(link.name, last)
                    # Let the data path start on this layer before the next
                    # committed one is cut into writes.
                    await asyncio.sleep(0)
                push.last_commit_at = time.monotonic()
                await asyncio.gather(*push.posts)
                checksum = await self._confirmation(push)
        except TimeoutError:
            self.fail(push, DeadlineExceeded(f"request {push.req} missed its deadline"))
            return
        except TransportError as exc:
            # The channel's failure, named after its receiver.
            self.fail(push, link.failure or exc)
            return
        except KvwireError as exc:
            self.fail(push, exc)
            return
        except Exception as exc:
            log.exception("internal error driving a push", req=push.req)
            self.fail(push, internal_error(exc, "sender daemon"))
            return
        self._finish(push, checksum)

    @staticmethod
    def _sent_callback(push: Push, layer: int) -> Callable[[asyncio.Future[None]], None]:
        # The engine may reuse a layer's staging once its writes are placed.
        def sent(posted: asyncio.Future[None]) -> None:
            if (not posted.cancelled() and posted.exception() is None and push.error is None
                    and push.on_sent is not None):
                push.on_sent(layer)
        return sent

    async def _confirmation(self, push: Push) -> int:
        """The receiver's checksum, once every write has been placed.

        It follows the last immediate at once; a receiver that stays silent
        after that has lost track of the request (a bug, or a stale lease),
        and the caller hears so rather than waiting forever.
        """
        wait = self.config.delivery_timeout
        try:
            return await asyncio.wait_for(asyncio.shield(push.confirmed), wait)
        except TimeoutError:
            raise PeerLost(
                f"receiver {push.link.name} has every byte of request {push.req} but did "
                f"not confirm delivery within {wait:g} s",
                hint="the receiver's log says why; the request was not delivered") from None

    @staticmethod
    def _loop_deadline(push: Push) -> float | None:
        if push.deadline is None:
            return None
        loop = asyncio.get_running_loop()
        return loop.time() + (push.deadline - time.monotonic())

    def _finish(self, push: Push, checksum: int) -> None:
        now = time.monotonic()
        timings: Timings = {
            "open_seconds": push.granted_at - push.opened_at,
            "transfer_seconds": now - (push.first_commit_at or push.granted_at),
            "total_seconds": now - push.opened_at,
            "post_seconds": push.post_seconds,
            "drain_seconds": now - (push.last_commit_at or now),
            "bytes": push.shape.total_bytes,
            "writes": push.writes,
        }
        self._forget(push)
        peer = push.link.name
        self.metrics.requests.labels(peer, "delivered").inc()
        self.metrics.request_seconds.labels(peer).observe(timings["total_seconds"])
        self.metrics.post_seconds.labels(peer).observe(timings["post_seconds"])
        self.metrics.wait_seconds.labels(peer).observe(timings["drain_seconds"])
        if not push.outcome.done():
            push.outcome.set_result(Delivery(checksum, timings))

    def fail(self, push: Push, error: KvwireError) -> None:
        """End a push that will not be delivered; cleanup runs in the background."""
        if push.error is not None or self.pushes.get(push.req) is not push:
            return
        push.error = error
        if push.task is not None and asyncio.current_task() is not push.task:
            push.task.cancel()
        spawn(self._cleanup_failed(push), f"abort-{push.req}")

    async def _cleanup_failed(self, push: Push) -> None:
        assert push.error is not None
        # The staging slot may only be reused once no write still reads it,
        # and the receiver may only reuse its slot once none can still land.
        await asyncio.gather(*push.posts, return_exceptions=True)
        link = push.link
        if link.connected:
            if push.aborted_by_receiver:
                link.send(message("abort_ack", req=push.req, lease=push.lease))
            else:
                link.send(message("abort", req=push.req, lease=push.lease,
                                  error=push.error.to_wire()))
        elif link.conn is not None:
            # The data channel died under a live control connection: drop both,
            # so the receiver voids every lease of this link.
            link.lost(PeerLost(f"the data channel to receiver {link.name} failed"))
        self._forget(push)
        self.metrics.requests.labels(link.name, "failed").inc()
        log.warning("push failed", req=push.req, peer=link.name, error=str(push.error))
        if not push.outcome.done():
            push.outcome.set_exception(push.error)
            push.outcome.exception()  # retrieved: whoever opened it may be gone

    def _forget(self, push: Push) -> None:
        if self.pushes.get(push.req) is push:
            del self.pushes[push.req]
        push.link.detach(push.lease)
        self.staging.release(push.staging)
        self.update_pool_metrics()

