"""One request on its way out: ``Push``, and the ``PushDriver`` that moves it.

The driver reserves staging and a lease, then turns each committed layer
into one post of writes per data channel (each channel's last write
carrying the immediate that announces the layer: kvwired.stripes). From
the grant on, every move of a push goes through its ``PushMachine``
(kvwired.lifecycle.push): the posting task, the link's messages, deadlines
and the engine only *feed events*; ``Push.event`` carries out the actions
the machine returns. So a push ends once, with the outcome the receiver
committed, and its staging goes back once, after no posted write and no
engine view can still touch it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from .. import immediate, stripes, verdicts
from ..config import SenderConfig
from ..errors import (
    DeadlineExceeded,
    DuplicateRequest,
    KvwireError,
    PeerLost,
    ProtocolError,
    RequestAborted,
    TransportError,
    UsageError,
    internal_error,
)
from ..layout import ChunkCursor, RequestShape
from ..lifecycle.push import PushAction, PushEvent, PushMachine, PushState
from ..lifecycle.staging import StagingAction, StagingEvent, StagingMachine
from ..metrics import Metrics
from ..pool import Pool, Slot
from ..protocol import control as ctl
from ..tasks import TaskSet
from ..transport.base import Write
from .channels import rail_label
from .link import PeerLink

log = structlog.get_logger("kvwired.sender")

Timings = dict[str, float]
VERDICT_HEARTBEATS = 2  # how long a push whose link was lost asks for its verdict


@dataclass(eq=False)
class Push:
    """One request from its grant to its staging back: what it holds, how far it got."""

    req: str
    link: PeerLink
    shape: RequestShape
    chunk_bytes: int
    staging: Slot
    lease: int
    remote_offset: int
    # The receiver's keys for this lease's bytes alone, one per channel (a
    # replaced channel's is changed in place: DataChannels._replace).
    keys: list[int]
    opened_at: float
    granted_at: float
    driver: PushDriver
    machine: PushMachine = field(init=False)
    deadline: float | None = None  # time.monotonic() at which an abort is requested
    # Layers up to n are placed remotely: the engine may reuse their staging.
    on_sent: Callable[[int], None] | None = None
    outcome: asyncio.Future[Delivery] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())
    commits: asyncio.Queue[int] = field(default_factory=asyncio.Queue)
    posts: list[asyncio.Future[None]] = field(default_factory=list)
    error: KvwireError | None = None  # why an abort was requested (or the link failed)
    checksum: int = 0
    post_seconds: float = 0.0
    first_commit_at: float = 0.0
    last_commit_at: float = 0.0
    writes: int = 0
    # The last layer's writes are posted: from here on the receiver may have
    # every byte, so a lost link leaves the outcome to be asked (ASKING).
    last_posted: bool = False
    task: asyncio.Task[None] | None = None  # the posting loop
    _timers: list[asyncio.TimerHandle] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.machine = PushMachine(self.req)
        self.machine.apply(PushEvent.GRANTED)
        # When its staging may go back: outcome known and views dropped, in
        # either order (kvwired.lifecycle.staging).
        self.staging_machine = StagingMachine(self.req)

    @property
    def state(self) -> PushState:
        return self.machine.state

    def later(self, delay: float, callback: Callable[..., object], *args: object) -> None:
        """Call ``callback(*args)`` in ``delay`` seconds, unless the push has ended by then."""
        self._timers.append(asyncio.get_running_loop().call_later(delay, callback, *args))

    def stop_timers(self) -> None:
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()

    def commit(self, layer: int) -> None:
        if self.first_commit_at == 0.0:
            self.first_commit_at = time.monotonic()
        self.commits.put_nowait(layer)

    def event(self, event: PushEvent) -> None:
        """Feed one event; carry out what the machine says."""
        for action in self.machine.apply(event):
            self.driver.carry_out(self, action)

    def abort(self, error: KvwireError) -> None:
        """Ask for an abort (deadline, engine): the receiver's verdict decides."""
        if self.machine.can(PushEvent.ABORT_REQUESTED):
            self.error = self.error or error
            self.event(PushEvent.ABORT_REQUESTED)

    def drop_views(self) -> None:
        """Whoever opened it holds no view of its staging any more: once the
        outcome is known too, the staging goes back to the pool."""
        if StagingAction.RETURN in self.staging_machine.apply(StagingEvent.VIEWS_DROPPED):
            self.event(PushEvent.VIEWS_DROPPED)

    def outcome_known(self) -> None:
        """Delivered or failed (called among the actions of that transition): if
        the views are dropped already, the staging goes back next turn."""
        if StagingAction.RETURN in self.staging_machine.apply(StagingEvent.OUTCOME_KNOWN):
            asyncio.get_running_loop().call_soon(self.event, PushEvent.VIEWS_DROPPED)

    # The link's LeaseHolder side.
    def delivered(self, checksum: int) -> None:
        self.checksum = checksum
        if self.machine.can(PushEvent.DELIVERED):
            self.event(PushEvent.DELIVERED)

    def fail(self, error: KvwireError, *, by_receiver: bool = False) -> None:
        if self.machine.ended:
            return
        self.error = error if by_receiver or self.error is None else self.error
        if by_receiver:
            self.event(PushEvent.RECEIVER_ABORT)
            return
        event = PushEvent.LINK_LOST_UNDECIDED if self.last_posted else PushEvent.LINK_LOST
        if self.machine.can(event):  # asking already: its verdict decides
            self.event(event)

    def abort_acked(self) -> None:
        if not self.machine.ended:
            self.event(PushEvent.ABORT_ACKED)

    @property
    def takes_writes(self) -> bool:
        return self.machine.posting

    def sent_when_placed(self, parts: list[asyncio.Future[None]], layer: int) -> None:
        """The engine may reuse a layer's staging once every channel's writes
        of it are placed: ``on_sent`` then."""
        left = len(parts)

        def sent(posted: asyncio.Future[None]) -> None:
            nonlocal left
            left -= 1
            if (left == 0 and all(not p.cancelled() and p.exception() is None for p in parts)
                    and not self.machine.ended and self.on_sent is not None):
                self.on_sent(layer)
        for part in parts:
            part.add_done_callback(sent)

    async def ask_verdict(self, within: float) -> None:
        """Reconnect and ask the receiver how this push ended (kvwired.verdicts).

        Within ``within`` seconds (``VERDICT_HEARTBEATS`` heartbeats), and
        without an answer the push fails with the link's error. The link was
        lost after a silence of four heartbeats, either this process's own (it
        was stopped: the receiver answers as soon as the link is back) or the
        receiver's (then another four would only delay the error: a receiver
        stopped and then killed by its watchdog took 12.5 s to fail in the
        lab, 6 s of them asking).
        """
        lost = self.error
        answer = await self.link.verdict(self.req, self.lease, within)
        if self.state is not PushState.ASKING:
            return
        verdict = None if answer is None else verdicts.from_message(answer)
        log.info("receiver's verdict after a lost link", req=self.req, peer=self.link.name,
                 verdict=verdicts.outcome(verdict))
        if verdict is None:
            self.event(PushEvent.VERDICT_UNKNOWN)
        elif verdict.delivered:
            if self.error is lost:
                self.error = None  # the lost link did not stop it: not late
            self.delivered(verdict.checksum)
        else:
            reason = verdict.error
            # Aborted because the connection was lost: our own account of that
            # loss (a stalled channel, a deadline) says more than the receiver's.
            if isinstance(reason, PeerLost) and self.error is not None:
                reason = self.error
            assert reason is not None, "an aborted verdict keeps its reason"
            self.fail(reason, by_receiver=True)


@dataclass(frozen=True)
class Delivery:
    """A push's good end: the receiver's checksum of every byte, and the timings."""

    checksum: int
    timings: Timings


class PushDriver:
    """Every push of one sender daemon, from open to its one outcome."""

    def __init__(self, config: SenderConfig, staging: Pool, metrics: Metrics,
                 ended: Callable[[], None] = lambda: None) -> None:
        self.config = config
        self.staging = staging
        self.metrics = metrics
        self._on_ended = ended  # a push's outcome is known (a drain waits for that)
        # Each push's posting, draining and asking (a push's own task is
        # cancelled when it ends; see _ended).
        self.tasks = TaskSet("pushes")
        self.pushes: dict[str, Push] = {}  # until their outcome is known
        self.holding: set[Push] = set()  # until their staging is back

    def update_pool_metrics(self) -> None:
        self.metrics.set_pool("staging", self.staging.size, self.staging.used_bytes)
        self.metrics.inflight.set(len(self.pushes))

    async def open(self, req: str, link: PeerLink, shape: RequestShape, chunk_bytes: int,
                   deadline: float | None = None, discard: bool = False,
                   note: dict[str, Any] | None = None) -> Push:
        """Staging and a lease for ``req``; the push is driven from then on.

        Raises a ``KvwireError`` (``DeadlineExceeded`` when ``deadline``
        seconds pass first); nothing is held then: a lease granted after the
        deadline is given back by the link.
        """
        opened_at = time.monotonic()
        self._check(req, shape, chunk_bytes)
        staging: Slot | None = None
        try:
            async with asyncio.timeout(deadline):
                staging = await self._reserve_staging(req, link, shape)
                push = await self._lease(req, link, shape, chunk_bytes, discard, opened_at,
                                         staging, note)
        except TimeoutError:
            error = DeadlineExceeded(
                f"request {req} could not be opened within its {deadline:g} s deadline",
                hint="raise the deadline, or check the receiver's pool and the link")
            if staging is None:
                link.withdraw(req, error)
            raise error from None
        self.pushes[req] = push
        self.holding.add(push)
        link.attach(push.lease, push, push.keys)
        self.update_pool_metrics()
        if deadline is not None:
            push.deadline = opened_at + deadline
            push.later(max(0.0, push.deadline - time.monotonic()), push.abort,
                       DeadlineExceeded(f"request {req} missed its {deadline:g} s deadline",
                                        hint="raise the deadline, or push less at once"))
        push.task = self.tasks.spawn(self._post(push), f"push-{req}")
        return push

    def _check(self, req: str, shape: RequestShape, chunk_bytes: int) -> None:
        if req in self.pushes:
            raise DuplicateRequest(f"request {req} is already being pushed",
                                   hint="request ids must be unique among pushes in flight")
        if shape.layers > immediate.MAX_LAYERS:
            raise UsageError(f"request {req} has {shape.layers} layers; at most "
                             f"{immediate.MAX_LAYERS} are supported")
        if chunk_bytes < 1:
            raise UsageError(f"chunk size {chunk_bytes} B is not positive")

    async def _reserve_staging(self, req: str, link: PeerLink, shape: RequestShape) -> Slot:
        """Staging for ``req``. A request refused here never reaches the receiver,
        so the receiver is told (``withdrawn``): its decode engine fails now,
        with the same error, rather than at its own timeout."""
        try:
            staging = await self.staging.reserve(shape.total_bytes, self.config.staging_wait)
        except KvwireError as exc:
            link.withdraw(req, exc)
            raise
        self.update_pool_metrics()
        return staging

    async def _lease(self, req: str, link: PeerLink, shape: RequestShape, chunk_bytes: int,
                     discard: bool, opened_at: float, staging: Slot,
                     note: dict[str, Any] | None) -> Push:
        try:
            await link.ensure()
            lease = await link.open(req, shape, discard, note)
            keys = lease.keys
            if len(keys) != len(link.channels):
                error = ProtocolError(
                    f"receiver {link.name} granted request {req} {len(keys)} keys for "
                    f"{len(link.channels)} data channels",
                    hint="run the same kvwire release on both ends")
                link.send(ctl.Abort(req=req, lease=lease.lease, error=error.to_wire()))
                raise error
        except BaseException:
            self.staging.release(staging)
            self.update_pool_metrics()
            raise
        return Push(req, link, shape, chunk_bytes, staging, lease.lease, lease.offset,
                    keys, opened_at, time.monotonic(), self)

    # ----------------------------------------------------------- data path

    async def _post(self, push: Push) -> None:
        """Commits become posts while the push is streaming; then wait for them."""
        link = push.link
        cursor = ChunkCursor(push.shape, push.chunk_bytes)
        peer_bytes = self.metrics.bytes.labels(link.name, "sent")
        plain_writes = self.metrics.writes.labels(link.name, "sent", "write")
        imm_writes = self.metrics.writes.labels(link.name, "sent", "write_imm")
        sizes = self.metrics.write_sizes
        try:
            while not cursor.done:
                layer = await push.commits.get()
                batch = cursor.commit(layer)
                if batch is None:
                    continue
                started = time.perf_counter()
                imm = immediate.pack(push.lease, batch.completes_layer)
                base_local, base_remote = push.staging.offset, push.remote_offset
                groups = stripes.stripe(batch.chunks, len(push.keys), first=batch.completes_layer)
                parts: list[asyncio.Future[None]] = []
                for number, group in enumerate(groups):
                    await link.take_credit(number)
                    if not push.machine.posting or len(link.channels) != len(push.keys):
                        raise PeerLost(f"receiver {link.name} went away")
                    # A channel with no chunk of this batch still announces it.
                    writes = ([Write(base_local + c.offset, base_remote + c.offset, c.length)
                               for c in group] or [Write(base_local, base_remote, 0)])
                    parts.append(link.data.post(number, writes, imm, push.lease))
                    rail = rail_label(link.rails[number])
                    self.metrics.rail_bytes.labels(link.name, rail).inc(
                        sum(c.length for c in group))
                    self.metrics.rail_writes.labels(link.name, rail).inc(len(writes))
                push.sent_when_placed(parts, batch.completes_layer)
                push.posts.extend(parts)
                push.post_seconds += time.perf_counter() - started
                push.writes += len(batch.chunks)
                plain_writes.inc(len(batch.chunks) - 1)
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
            push.last_posted = True
            # asyncio.wait, not gather: an abort cancels this task, and a
            # cancelled gather cancels the posts it waits for, which would
            # let the drain report them done while their writes are still on
            # the wire (found by per-lease keys: a write after the abort).
            if push.posts:
                await asyncio.wait(push.posts)
            for posted in push.posts:
                if (error := posted.exception()) is not None:
                    raise error
        except asyncio.CancelledError:
            return  # an abort stopped the posting; the drain waits for what was posted
        except TransportError as exc:
            # The channel's failure, named after its receiver.
            self._posting_failed(push, link.data.failure or exc)
            return
        except KvwireError as exc:
            self._posting_failed(push, exc)
            return
        except Exception as exc:
            log.exception("internal error driving a push", req=push.req)
            self._posting_failed(push, internal_error(exc, "sender daemon"))
            return
        if push.machine.can(PushEvent.ALL_POSTED):
            push.event(PushEvent.ALL_POSTED)
        if push.state is PushState.CONFIRMING:
            self._bound_confirmation(push)

    @staticmethod
    def _posting_failed(push: Push, error: KvwireError) -> None:
        """Posting ``push`` failed: that push fails, and only it. A failed data
        channel has already been judged by the link (replaced, or the link
        lost, which failed every push on it: kvwired.sender.channels), so a
        push still posting failed on its own (a bug here, say): its lease is
        aborted, and the receiver's verdict ends it."""
        push.error = push.error or error
        if push.machine.posting:
            push.abort(error)

    def _bound_confirmation(self, push: Push) -> None:
        """A receiver that has every byte confirms at once; one that stays
        silent has lost track of the request: the push is aborted, and the
        abort's answer (which the link bounds) decides."""
        wait = self.config.delivery_timeout

        def expired() -> None:
            if push.state is PushState.CONFIRMING:
                push.error = PeerLost(
                    f"receiver {push.link.name} has every byte of request {push.req} but did "
                    f"not confirm delivery within {wait:g} s",
                    hint="the receiver's log says why; the request was not delivered")
                push.abort(push.error)
        push.later(wait, expired)

    def _drain(self, push: Push) -> None:
        """POSTS_DONE once no posted write of ``push`` is outstanding.

        An abort was asked for (a deadline, the engine), so the drain does not
        give a channel the whole stall bound: one that completes nothing for a
        heartbeat while this push waits on it is declared stalled, and the
        push ends within about two heartbeats of its deadline, whatever the
        transport is doing. A channel that moves, however slowly, is waited for.
        """
        heartbeat = self.config.heartbeat
        loop = asyncio.get_running_loop()

        async def drained() -> None:
            pending = {p for p in push.posts if not p.done()}
            while pending:
                began = loop.time()
                # asyncio.wait never cancels them (see _post).
                _, pending = await asyncio.wait(pending, timeout=heartbeat)
                # Overshot by more than a heartbeat: this process was stopped or
                # starved, and completions may sit unread; look again first.
                if pending and loop.time() - began <= 2 * heartbeat:
                    push.link.data.check_progress(heartbeat)
            if push.machine.can(PushEvent.POSTS_DONE):
                push.event(PushEvent.POSTS_DONE)
        self.tasks.spawn(drained(), f"drain-{push.req}")

    # ------------------------------------------------------------- actions

    def carry_out(self, push: Push, action: PushAction) -> None:
        link = push.link
        if action is PushAction.STOP_POSTING:
            if push.task is not None and push.task is not asyncio.current_task():
                push.task.cancel()
            if push.state in (PushState.DRAINING, PushState.DRAINING_FOR_ACK):
                self._drain(push)
        elif action is PushAction.SEND_ABORT:
            error = push.error or RequestAborted(f"request {push.req} was aborted")
            link.send(ctl.Abort(req=push.req, lease=push.lease, error=error.to_wire()))
            wait = self.config.delivery_timeout
            link.holders.owe_answer(push.lease, wait, PeerLost(
                f"receiver {link.name} did not answer the abort of request {push.req} "
                f"within {wait:g} s", hint="the link was dropped, which voids every lease "
                "on it; the receiver's log says why it stayed silent"))
        elif action is PushAction.SEND_ABORT_ACK:
            link.send(ctl.AbortAck(req=push.req, lease=push.lease))
        elif action is PushAction.REPORT_FINISHED:
            self._finish(push)
        elif action is PushAction.REPORT_FAILED:
            self._fail(push)
        elif action is PushAction.ASK_VERDICT:
            # The push leaves the link's holders: the ask decides it now,
            # whatever becomes of the connection it was posted on.
            link.detach(push.lease)
            self.tasks.spawn(push.ask_verdict(VERDICT_HEARTBEATS * self.config.heartbeat),
                             f"ask-{push.req}")
        elif action is PushAction.RELEASE_STAGING:
            self.holding.discard(push)
            self.staging.release(push.staging)
            self.update_pool_metrics()

    def _ended(self, push: Push) -> None:
        push.stop_timers()
        push.outcome_known()
        if self.pushes.get(push.req) is push:
            del self.pushes[push.req]
        push.link.detach(push.lease)
        if push.task is not None and push.task is not asyncio.current_task():
            push.task.cancel()
        self.update_pool_metrics()
        self._on_ended()

    def _finish(self, push: Push) -> None:
        self._ended(push)
        now = time.monotonic()
        late = push.deadline is not None and now > push.deadline
        timings: Timings = {
            "open_seconds": push.granted_at - push.opened_at,
            "transfer_seconds": now - (push.first_commit_at or push.granted_at),
            "total_seconds": now - push.opened_at,
            "post_seconds": push.post_seconds,
            "drain_seconds": now - (push.last_commit_at or now),
            "bytes": push.shape.total_bytes,
            "writes": push.writes,
            # Delivered although an abort was asked for (deadline, engine):
            # the receiver had every byte first.
            "late": float(late or push.error is not None),
        }
        peer = push.link.name
        self.metrics.requests.labels(peer, "delivered").inc()
        self.metrics.request_seconds.labels(peer).observe(timings["total_seconds"])
        self.metrics.post_seconds.labels(peer).observe(timings["post_seconds"])
        self.metrics.wait_seconds.labels(peer).observe(timings["drain_seconds"])
        if push.error is not None:
            log.info("push delivered although an abort was asked for", req=push.req,
                     peer=peer, reason=str(push.error))
        else:
            # One line per request, as the receiver logs it: what a request's
            # transfer cost, and how much of it came after the engine's last
            # layer (drain: what overlap with compute did not hide).
            log.info("push delivered", req=push.req, peer=peer, bytes=push.shape.total_bytes,
                     transfer_seconds=round(timings["transfer_seconds"], 6),
                     drain_seconds=round(timings["drain_seconds"], 6))
        if not push.outcome.done():
            push.outcome.set_result(Delivery(push.checksum, timings))

    def _fail(self, push: Push) -> None:
        self._ended(push)
        error = push.error or PeerLost(f"receiver {push.link.name} aborted request {push.req}")
        self.metrics.requests.labels(push.link.name, "failed").inc()
        log.warning("push failed", req=push.req, peer=push.link.name, error=str(error))
        if not push.outcome.done():
            push.outcome.set_exception(error)
            push.outcome.exception()  # retrieved: whoever opened it may be gone
