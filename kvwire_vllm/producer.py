"""The prefill engine's worker side: each layer into the push, as it is computed.

In the step that completes a request's prompt, vLLM calls ``save_kv_layer``
after each attention layer has written its KV. The request's blocks of that
layer are copied into the push's staging (registered memory of the local
sender daemon), sealed, and committed, so layer n travels while the engine
computes layer n + 1. Nothing of the engine's waits on the wire: once the
last layer is in staging the engine's blocks are free.

A push that cannot be opened (the receiver's pool is full, no daemon, ...)
is logged and counted; the decode engine learns it from its receiver or
its deadline and computes the prompt itself.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import time
from dataclasses import dataclass, field

import torch

from kvwired.client import LoopThread, OutgoingPush, SenderClient
from kvwired.errors import KvwireError
from kvwired.layout import RequestShape

from .cache import KVCacheBlocks
from .params import ConnectorSettings
from .scheduling import PushPlan
from .seal import SEAL_BYTES, LayerSeal, layer_bytes, seal_layer, transfer_hash
from .stats import ConnectorCounters

log = logging.getLogger("vllm.kvwire.producer")
# How long the first layer's copy waits for its push to be opened (a lease
# from the receiver, one round trip): past this the push is given up.
OPEN_WAIT = 10.0


@dataclass
class _Push:
    plan: PushPlan
    opening: concurrent.futures.Future[OutgoingPush]
    block_ids: torch.Tensor
    seal: LayerSeal
    started: float
    committed: int = 0
    failed: bool = False
    done: set[int] = field(default_factory=set)


class Producer:
    def __init__(self, settings: ConnectorSettings, cache: KVCacheBlocks,
                 counters: ConnectorCounters) -> None:
        self.settings = settings
        self.cache = cache
        self.counters = counters
        self.thread = LoopThread()
        self._client: SenderClient | None = None
        self._connecting = asyncio.Lock()
        self._pushes: list[_Push] = []
        self._finishing: set[asyncio.Task[None]] = set()  # touched on the loop only

    def begin_step(self, plans: list[PushPlan]) -> None:
        """Before the forward pass: ask the daemon for this step's pushes."""
        for plan in plans:
            blocks = len(plan.block_ids)
            seal = LayerSeal(0, self.cache.layers, blocks, self.cache.block_size,
                             self.cache.block_bytes, transfer_hash(plan.order.transfer),
                             self.cache.layout, 0)
            self._pushes.append(_Push(plan, self.thread.submit(self._open(plan)),
                                      torch.tensor(plan.block_ids, dtype=torch.int64), seal,
                                      time.perf_counter()))

    async def _sender(self) -> SenderClient:
        """The connection to the sender daemon; a new one after a daemon restart."""
        async with self._connecting:
            if self._client is None or self._client.conn.broken is not None:
                if self._client is not None:
                    await self._client.close()
                self._client = None
                self._client = await SenderClient.connect(self.settings.sender_socket)
            return self._client

    async def _open(self, plan: PushPlan) -> OutgoingPush:
        client = await self._sender()
        shape = RequestShape(self.cache.layers,
                             layer_bytes(len(plan.block_ids), self.cache.block_bytes))
        return await client.open(plan.order.transfer, plan.order.receiver, shape,
                                 deadline=plan.deadline)

    def save_layer(self, layer_name: str) -> None:
        """After layer ``layer_name``'s attention wrote its KV: copy, seal, commit."""
        n = self.cache.index.get(layer_name)
        if n is None:
            return
        for push in self._pushes:
            if push.failed:
                continue
            try:
                outgoing = push.opening.result(timeout=OPEN_WAIT)
                layer = outgoing.layer(n)
                self.cache.read_blocks(n, push.block_ids, layer[: len(layer) - SEAL_BYTES])
                seal_layer(layer, dataclasses.replace(push.seal, layer=n))
            except (KvwireError, concurrent.futures.TimeoutError) as exc:
                self._give_up(push, exc)
                continue
            self.thread.loop.call_soon_threadsafe(self._commit, push, outgoing, n)

    def _commit(self, push: _Push, outgoing: OutgoingPush, n: int) -> None:
        if push.failed:
            return
        try:
            outgoing.commit(n)
        except KvwireError as exc:
            self._give_up(push, exc)
            return
        push.committed += 1
        if push.committed == self.cache.layers:
            task = self.thread.loop.create_task(self._finish(push, outgoing))
            self._finishing.add(task)
            task.add_done_callback(self._finishing.discard)

    async def _finish(self, push: _Push, outgoing: OutgoingPush) -> None:
        try:
            result = await outgoing.finish()
        except KvwireError as exc:
            self._give_up(push, exc)
            return
        seconds = time.perf_counter() - push.started
        self.counters.pushed(result.bytes, seconds)
        log.debug("kvwire: pushed %s (%d B) in %.3f s", push.plan.order.transfer,
                  result.bytes, seconds)

    def _give_up(self, push: _Push, exc: BaseException) -> None:
        if push.failed:
            return
        push.failed = True
        code = exc.code if isinstance(exc, KvwireError) else "open_timeout"
        self.counters.failed("push", code)
        log.warning("kvwire: push of %s (request %s) failed: %s; the decode engine will "
                    "compute its prompt", push.plan.order.transfer, push.plan.req_id, exc)
        if push.opening.done() and not push.opening.cancelled() \
                and push.opening.exception() is None:
            self.thread.loop.call_soon_threadsafe(push.opening.result().abort)

    def end_step(self) -> None:
        """After the forward pass: every layer of this step's pushes is in staging."""
        self._pushes = []

    def close(self) -> None:
        """Waits for the pushes in flight (each ends by its deadline): an engine
        that stops right after its last prefill still delivers it."""
        async def drain() -> None:
            if self._finishing:
                await asyncio.wait(set(self._finishing))
            if self._client is not None:
                await self._client.close()
                self._client = None
        if self.thread.loop.is_running():
            self.thread.run(drain())
            self.thread.stop()
