"""The prefill engine's worker side: each layer into the push, as it is computed.

In the step that completes a request's prompt, vLLM calls ``save_kv_layer``
after each attention layer has written its KV. The request's blocks of that
layer are copied into the push's staging (registered memory of the local
sender daemon), sealed, and committed, so layer n travels while the engine
computes layer n + 1.

The forward pass never waits on the network, nor on the copy: a layer's
copy into staging and its seal run on a thread of their own while the pass
goes on. A push is opened before the
pass starts (a lease from the receiver: one round trip); if it is not open
when a layer is done (a full pool makes the receiver wait for room), that
layer and the rest are copied later, from vLLM's blocks, on the client's
thread, once it opens. So vLLM holds a pushed request's blocks until the
worker says its bytes are all in staging (``finished_sending``): at once
for the usual push, later for a deferred one, never past the open's end.

A push that cannot be opened (the receiver's pool stays full, no daemon,
...) is logged and counted; the decode engine learns it from its receiver
and computes the prompt itself.

A request is several pushes: one per KV head this rank pushes (and per
KV-cache group), kvwire_vllm.shards says which. A rank that pushes none (a
replica of a head another rank pushes) still tells vLLM it is done with the
request's blocks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from kvwired import tracing
from kvwired.client import LoopThread, OutgoingPush, SenderClient
from kvwired.errors import KvwireError
from kvwired.layout import RequestShape

from .cache import KVCacheBlocks
from .daemon_link import DaemonLink
from .describe import CacheGroup
from .params import ConnectorSettings
from .scheduling import PushPlan
from .seal import SEAL_BYTES, LayerSeal, layer_bytes, seal_layer, transfer_hash
from .stats import ConnectorCounters

log = logging.getLogger("vllm.kvwire.producer")


@dataclass
class _Push:
    """One head's push (of one KV-cache group) of a planned request."""

    plan: PushPlan
    name: str  # the daemons' request id
    group: CacheGroup
    head: int  # on this rank's head axis
    block_ids: torch.Tensor
    seal: LayerSeal
    started: float
    opening: concurrent.futures.Future[OutgoingPush] = field(init=False)  # its open
    submitted: int = 0  # layers handed to the stager, in order
    deferred: bool = False  # a layer was done before the push was open
    failed: bool = False
    # Its part of the request's trace: from the step that computes the
    # prompt's last chunk to delivered (or failed).
    span: tracing.Span = tracing.NO_SPAN


class Producer:
    def __init__(self, settings: ConnectorSettings, cache: KVCacheBlocks, rank: int,
                 counters: ConnectorCounters) -> None:
        self.settings = settings
        self.cache = cache
        self.rank = rank
        self.counters = counters
        self.thread = LoopThread()
        self._stager = ThreadPoolExecutor(1, thread_name_prefix="kvwire-stage")
        self._closed = False
        self._daemon = DaemonLink(lambda: SenderClient.connect(self.settings.sender_socket))
        self._step: list[_Push] = []  # this forward pass's pushes
        self._tasks: set[asyncio.Task[None]] = set()  # touched on the loop only
        self._lock = threading.Lock()
        self._pushing: set[str] = set()  # requests whose blocks vLLM holds for a push
        self._staging: dict[str, int] = {}  # ... and their pushes not all in staging yet
        self._released: set[str] = set()  # ... which may be freed now
        self._finished: set[str] = set()  # ... which vLLM said finished

    def begin_step(self, plans: list[PushPlan]) -> None:
        """Before the forward pass: ask the daemon for this step's pushes."""
        engine = self.cache.engine
        heads = engine.placement.pushes(self.rank)
        for plan in plans:
            pushes = engine.head_pushes(plan.order.transfer, heads, self.rank)
            with self._lock:
                self._pushing.add(plan.req_id)
                if pushes:
                    self._staging[plan.req_id] = len(pushes)
                else:
                    self._released.add(plan.req_id)  # a replica: nothing of its own
            for target in pushes:
                group = target.group
                blocks = plan.blocks[group.index]
                seal = LayerSeal(0, len(group.layer_names), len(blocks),
                                 self.cache.block_size, group.head_bytes,
                                 transfer_hash(target.name), self.cache.fingerprint, 0)
                push = _Push(plan, target.name, group, target.head,
                             torch.tensor(blocks, dtype=torch.int64), seal,
                             time.perf_counter())
                push.span = tracing.start("kvwire.push", plan.order.trace, {
                    "kvwire.transfer": plan.order.transfer, "kvwire.push": target.name,
                    "kvwire.rank": self.rank, "kvwire.layers": len(group.layer_names)})
                push.opening = self.thread.submit(self._open(push))
                self._step.append(push)

    async def _open(self, push: _Push) -> OutgoingPush:
        client = await self._daemon.client()
        shape = RequestShape(len(push.group.layer_names),
                             layer_bytes(len(push.block_ids), push.group.head_bytes))
        push.span.add_event("open sent")
        # The layout travels with the open: a decode engine asked before this
        # engine answered (the proxy's parallel flow) checks it before a layer lands.
        opened = await client.open(push.name, push.plan.order.receiver, shape,
                                   deadline=push.plan.deadline,
                                   note=self.cache.layout.to_params())
        push.span.add_event("lease granted")
        return opened

    def save_layer(self, layer_name: str) -> None:
        """After layer ``layer_name``'s attention wrote its KV: copy, seal, commit
        (or leave it in vLLM's blocks, when the push is not open yet)."""
        where = self.cache.where.get(layer_name)
        if where is None:
            return
        group, n = where
        for push in self._step:
            if push.group is not group or push.failed or push.deferred:
                continue
            if not push.opening.done():
                push.deferred = True  # this layer and the rest: once it opens
                push.span.set_attribute("kvwire.deferred_from_layer", n)
                continue
            try:
                outgoing = push.opening.result()
            except KvwireError as exc:
                self._give_up(push, exc)
                continue
            # The copy and the seal's hash run on the stager's thread (both
            # release the GIL), so the forward pass goes on to the next layer
            # at once; the blocks stay vLLM's until they are all staged.
            self._stager.submit(self._stage, push, outgoing, n)
            push.submitted = n + 1

    def _stage(self, push: _Push, outgoing: OutgoingPush, n: int) -> None:
        """Layer ``n`` into staging, sealed, and committed (on the stager's thread)."""
        if push.failed:
            return
        try:
            self._copy_and_seal(push, outgoing, n)
        except KvwireError as exc:
            self._give_up(push, exc)

    def _copy_and_seal(self, push: _Push, outgoing: OutgoingPush, n: int) -> None:
        layer = outgoing.layer(n)
        self.cache.read_head(push.group.layer_names[n], push.head, push.block_ids,
                             layer[: len(layer) - SEAL_BYTES])
        seal_layer(layer, dataclasses.replace(push.seal, layer=n))
        self.thread.loop.call_soon_threadsafe(self._commit, push, outgoing, n)

    def _commit(self, push: _Push, outgoing: OutgoingPush, n: int) -> None:
        if push.failed:
            return
        last = n == len(push.group.layer_names) - 1
        # Recorded before the commit is handed on: once it is, the layer may
        # land at the decode node before this thread runs again.
        if n == 0:
            push.span.add_event("first layer staged")
        if last:
            push.span.add_event("last layer staged")
        try:
            outgoing.commit(n)
        except KvwireError as exc:
            self._give_up(push, exc)
            return
        if last:
            self._spawn(self._finish(push, outgoing))

    def end_step(self) -> None:
        """After the forward pass: pushes whose every layer is in staging let
        their blocks go; deferred ones continue on the client's thread."""
        for push in self._step:
            if push.deferred and not push.failed:
                self.thread.loop.call_soon_threadsafe(
                    self._spawn, self._stage_deferred(push))
            else:
                self._stager.submit(self._release, push)  # after its layers: one thread
        self._step = []

    async def _stage_deferred(self, push: _Push) -> None:
        try:
            outgoing = await asyncio.wrap_future(push.opening)
            for n in range(push.submitted, len(push.group.layer_names)):
                await asyncio.wrap_future(self._stager.submit(self._stage, push, outgoing, n))
        except KvwireError as exc:
            self._give_up(push, exc)
        finally:
            self._release(push)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = self.thread.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _finish(self, push: _Push, outgoing: OutgoingPush) -> None:
        try:
            result = await outgoing.finish()
        except KvwireError as exc:
            self._give_up(push, exc)
            return
        seconds = time.perf_counter() - push.started
        push.span.set_attribute("kvwire.bytes", result.bytes)
        push.span.add_event("delivered")
        push.span.end()
        self.counters.pushed(result.bytes, seconds)
        log.debug("kvwire: pushed %s (%d B) in %.3f s", push.name, result.bytes, seconds)

    def _give_up(self, push: _Push, exc: BaseException) -> None:
        if push.failed:
            return
        push.failed = True
        code = exc.code if isinstance(exc, KvwireError) else "error"
        tracing.fail(push.span, f"{code}: {exc}")
        push.span.end()
        self.counters.failed("push", code)
        log.warning("kvwire: push of %s (request %s) failed: %s; the decode engine will "
                    "compute its prompt", push.name, push.plan.req_id, exc)
        if push.opening.done() and not push.opening.cancelled() \
                and push.opening.exception() is None:
            self.thread.loop.call_soon_threadsafe(push.opening.result().abort)

    def _release(self, push: _Push) -> None:
        """One push's bytes are staged (or it failed): once all the request's
        are, vLLM may free its blocks."""
        req_id = push.plan.req_id
        with self._lock:
            left = self._staging.get(req_id, 1) - 1
            if left > 0:
                self._staging[req_id] = left
                return
            self._staging.pop(req_id, None)
            self._released.add(req_id)

    def finished_sending(self, finished_req_ids: set[str]) -> set[str]:
        """Requests whose blocks vLLM may free now: their bytes are in staging
        (or their push failed) and vLLM has finished them."""
        with self._lock:
            self._finished |= finished_req_ids & self._pushing
            done = self._released & self._finished
            self._released -= done
            self._finished -= done
            self._pushing -= done
            return done

    def close(self) -> None:
        """Waits for the pushes in flight (each ends by its deadline): an engine
        that stops right after its last prefill still delivers it."""
        async def drain() -> None:
            while self._tasks:
                await asyncio.wait(set(self._tasks))
            await self._daemon.close()
        if self._closed:
            return
        self._closed = True
        self._stager.submit(lambda: None).result()  # what was handed over is staged
        if self.thread.loop.is_running():
            self.thread.run(drain())
            self.thread.stop()
        self._stager.shutdown(wait=True)
