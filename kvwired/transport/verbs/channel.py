"""The initiator's end: a queue pair whose send queue carries the writes.

Writes are posted a burst per call into the compiled core (chained work
requests, one doorbell per burst), in the bursts and with the signals that
``SendQueue`` decides; completions come back from the completion queue in
batches and end the posts they account for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from ...errors import TransportError
from ..base import DataChannel, Initiator, Write
from . import core
from .completions import Completion, completion_error
from .core import VerbsError
from .queue_pair import Endpoint, QueuePair, QueuePairs
from .send_queue import Post, SendQueue

Future = asyncio.Future[None]


class VerbsDataChannel(DataChannel):
    """Posts writes on an RC QP; one completion per post tells they landed."""

    kind = "verbs"

    def __init__(self, qp: QueuePair, remote: dict[str, Any]) -> None:
        self._qp = qp
        self._rkey = int(remote["rkey"])
        self._remote_base = int(remote["addr"])
        self._remote_size = int(remote["size"])
        self._local_base = qp.device.base
        self._lkey = qp.device.mr.lkey
        self._max_message = qp.device.max_message(qp.gid.port)
        self._sq: SendQueue[Future] = SendQueue()
        self._error: TransportError | None = None
        qp.cq.busy = lambda: self._sq.outstanding > 0

    @property
    def alive(self) -> bool:
        return self._error is None

    def post(self, writes: Sequence[Write], imm: int | None = None,
             key: int | None = None) -> Future:
        future: Future = asyncio.get_running_loop().create_future()
        if self._error is not None:
            future.set_exception(self._error)
            return future
        for w in writes:
            if w.remote_offset + w.length > self._remote_size:
                future.set_exception(TransportError(
                    f"write of {w.length} B at {w.remote_offset} is outside the remote "
                    f"{self._remote_size} B region"))
                return future
        self._posting()
        self._sq.add(Post(self._split(writes), imm, self._rkey if key is None else key, future))
        self._post_some()
        self._qp.cq.kick()
        return future

    @property
    def pending_writes(self) -> int:
        return self._sq.pending_writes

    def poll_now(self) -> None:
        """Read whatever completions are there, without waiting for the event
        loop to be woken: for a caller that busy-polls (the completion-path
        benchmark measures what sleeping costs against it)."""
        self._qp.cq.drain()

    def _split(self, writes: Sequence[Write]) -> Sequence[Write]:
        # A message may not exceed the port's max_msg_sz (8 MiB on rxe).
        if all(w.length <= self._max_message for w in writes):
            return writes
        pieces = []
        for w in writes:
            for start in range(0, w.length, self._max_message):
                length = min(self._max_message, w.length - start)
                pieces.append(Write(w.local_offset + start, w.remote_offset + start, length))
        return pieces

    def _post_some(self) -> None:
        """Put as many writes on the send queue as fit, a burst at a time."""
        qp, sq = self._qp.qp, self._sq
        while self._error is None and (burst := sq.next_burst()) is not None:
            post = burst.post
            try:
                qp.post_writes(post.writes, burst.start, burst.end, self._local_base,
                               self._lkey, self._remote_base, post.key, post.imm,
                               burst.signalled)
            except VerbsError as exc:
                self.fail(TransportError(f"posting RDMA writes failed: {exc}"))
                return
            sq.posted(burst)

    def on_completions(self, completions: list[Completion]) -> None:
        for wr_id, status, _, _ in completions:
            if status != core.IBV_WC_SUCCESS:
                self.fail(completion_error(status, self._qp.qp.qp_num, "RDMA write"))
                return
            self._progressed()
            for future in self._sq.completed(wr_id):
                if not future.done():
                    future.set_result(None)
        self._post_some()

    def _take_outstanding(self) -> list[Future]:
        return self._sq.take_outstanding()

    def _tear_down(self) -> None:
        self._qp.close()


class VerbsInitiator(Initiator):
    def __init__(self, owner: QueuePairs, local_host: str, rail: str = "") -> None:
        self._owner = owner
        self._local_host = local_host
        self._rail = rail
        self._qp: QueuePair | None = None
        self._channel: VerbsDataChannel | None = None

    async def offer(self) -> dict[str, Any]:
        self._qp = self._owner.queue_pair(self._local_host, 0, self._on_completions,
                                          rail=self._rail)
        offer = self._qp.endpoint.to_wire()
        if self._rail:
            # The responder answers from its own end of this rail: the GID its
            # routes reach ours from, not its control connection's.
            offer["rail"] = self._rail
        return offer

    def _on_completions(self, completions: list[Completion]) -> None:
        if self._channel is not None:
            self._channel.on_completions(completions)

    async def complete(self, answer: dict[str, Any]) -> DataChannel:
        assert self._qp is not None, "offer() first"
        self._qp.connect(Endpoint.from_wire(answer))
        try:
            self._channel = VerbsDataChannel(self._qp, answer)
        except (KeyError, TypeError, ValueError) as exc:
            raise TransportError(f"receiver sent no usable region: {answer!r}") from exc
        return self._channel

    def abandon(self) -> None:
        if self._qp is not None and self._channel is None:
            self._qp.close()
