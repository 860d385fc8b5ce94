"""The decode engine's worker side: a request's blocks from the receive pool.

Loads are asynchronous: vLLM keeps decoding its other requests while one
request waits for its KV (``WAITING_FOR_REMOTE_KVS``). Each load waits for
its receiver daemon to say the push was delivered, checks every layer's seal,
copies the blocks into the ones vLLM allocated, and releases the slot.

A load ends exactly once, and before its deadline plus a grace: delivered
and copied, or failed (the receiver's verdict, a broken seal, the daemon
gone, the deadline). A failed load reports its blocks as load errors; vLLM
then recomputes the prompt (``kv_load_failure_policy = "recompute"``) or
fails the request (``"fail"``). The engine never runs on blocks a load has
not finished writing: vLLM hears "finished" only after the load's last
copy, also when the request was aborted meanwhile.

A load is several pushes: one per KV head this rank holds (and per KV-cache
group), from whichever prefill ranks pushed them (kvwire_vllm.shards); it
ends when every one is copied, or at the first that fails, and releases
them all either way. A push several ranks read (a head they all hold, an
MLA cache) is freed by the receiver at its last reader's release. vLLM
decodes a request only once every rank's load has ended, and recomputes
(or fails) it if any rank's failed: no rank decodes on a partial set.

A load the scheduler refused (the prefill engine's layout cannot be taken
here) fails at once, and its pushes are released as they open, so they do
not sit in the receive pool. Asked before the prefill engine announced its
layout (the proxy's parallel flow), a load reads it off each push's open,
before any layer lands, and refuses there.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Iterable

import numpy as np
import torch

from kvwired import tracing
from kvwired.client import LayerLanded, LoopThread, PushOpened, ReceiverClient
from kvwired.errors import KvwireError

from .blockmap import Gather, TokenMap, plan_gather, regroup, regroup_index
from .cache import KVCacheBlocks
from .daemon_link import DaemonLink
from .describe import HeadPush
from .loads import EndedLoads
from .params import ConnectorSettings
from .scheduling import NULL_BLOCK, LoadPlan, blocks_of, pushed_from
from .seal import (
    SEAL_BYTES,
    LayerSeal,
    SealBroken,
    check_layer,
    layer_bytes,
    layout_fingerprint,
    transfer_hash,
)
from .shards import EngineLayout, LayoutMismatch
from .stats import ConnectorCounters

log = logging.getLogger("vllm.kvwire.consumer")
# Seconds an engine that stops gives its refused pushes to be released; those
# still arriving then are reclaimed by the receiver as it leaves.
DISCARD_GRACE = 2.0


class Consumer:
    def __init__(self, settings: ConnectorSettings, cache: KVCacheBlocks, rank: int,
                 counters: ConnectorCounters) -> None:
        self.settings = settings
        self.cache = cache
        self.rank = rank
        self.counters = counters
        self.thread = LoopThread()
        self._daemon = DaemonLink(lambda: ReceiverClient.connect(self.settings.receiver_socket))
        self._tasks: dict[str, asyncio.Task[None]] = {}  # touched on the loop only
        self._discards: set[asyncio.Task[None]] = set()  # refused loads' pushes
        self._lock = threading.Lock()
        self._loads = EndedLoads()
        self._failed_blocks: set[int] = set()
        # Per loaded request, per layer: its kept blocks' ids and loaded bytes,
        # until the step that computes its tail writes them back.
        self._kept: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._restoring: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        # Per load, its part of the request's trace: from the moment it waits
        # for the push to the moment vLLM is told it ended.
        self._spans: dict[str, tracing.Span] = {}

    def begin_step(self, plans: list[LoadPlan], restores: Iterable[str] = ()) -> None:
        self._loads.begun(len(plans))
        for plan in plans:
            self.thread.submit(self._run(plan))
        with self._lock:
            self._restoring = [kept for req_id in restores
                               if (kept := self._kept.pop(req_id, None)) is not None]

    def end_step(self) -> None:
        """After the forward pass of a step computing loaded requests' tails:
        their kept blocks get the pushed bytes back, every layer (vLLM's CPU
        MLA calls no per-layer hook, so this is the one place)."""
        for kept in self._restoring:
            for layer, (ids, data) in kept.items():
                self.cache.tensors[layer][ids] = data
        self._restoring = []

    def _keep(self, plan: LoadPlan) -> None:
        """The loaded bytes of ``plan``'s kept blocks (vLLM computes those
        tokens again; the prefill engine's bytes are written back after)."""
        kept = {}
        for group, load in zip(self.cache.engine.groups, plan.groups, strict=True):
            if not load.kept:
                continue
            # One index for the group: its layers share the engine's device.
            device = self.cache.tensors[group.layer_names[0]].device
            ids = torch.tensor(load.kept, dtype=torch.int64, device=device)
            for name in group.layer_names:
                kept[name] = (ids, self.cache.tensors[name][ids].clone())
        if kept:
            with self._lock:
                self._kept[plan.req_id] = kept

    async def _run(self, plan: LoadPlan) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks[plan.req_id] = task
        started = time.perf_counter()
        span = tracing.start("kvwire.load", plan.order.trace, {
            "kvwire.transfer": plan.order.transfer, "kvwire.rank": self.rank,
            "kvwire.tokens": plan.tokens})
        with self._lock:
            self._spans[plan.req_id] = span
        failed = True
        try:
            try:
                await self._load(plan, span)
            except BaseExceptionGroup as group:  # the first push's failure says why
                raise _first(group) from group
        except (KvwireError, TimeoutError, asyncio.CancelledError) as exc:
            tracing.fail(span, type(exc).__name__ if isinstance(exc, asyncio.CancelledError)
                         else str(exc) or type(exc).__name__)
            self._failed_load(plan, exc)
        except Exception as exc:  # a bug here must not leave the request waiting
            log.exception("kvwire: load of %s broke", plan.order.transfer)
            tracing.fail(span, repr(exc))
            self._failed_load(plan, exc)
        else:
            failed = False
            self._keep(plan)
            self.counters.loaded(plan.loaded,
                                 self._bytes(plan), time.perf_counter() - started)
        finally:
            self._tasks.pop(plan.req_id, None)
            self._loads.ended(plan.req_id, failed)

    async def _load(self, plan: LoadPlan, span: tracing.Span) -> None:
        """Each push's layers are checked and copied as they land (while the
        prefill engine still computes the next ones); the load is done once
        every layer of every push is copied and the receiver says each push
        is delivered."""
        if plan.refusal is not None:
            client = await self._daemon.client()
            pushes = self._pushes(plan)
            for push in pushes:  # held from now: reclaimed if this engine goes
                client.subscribe(push.name, push.readers)
            task = self.thread.loop.create_task(self._discard(client, plan, pushes))
            self._discards.add(task)
            task.add_done_callback(self._discards.discard)
            raise LayoutMismatch(f"request {plan.req_id}: {plan.refusal}")
        client = await self._daemon.client()
        async with asyncio.timeout(plan.order.wait), asyncio.TaskGroup() as group:
            for push in self._pushes(plan):
                group.create_task(self._load_push(client, plan, push, span))

    def _pushes(self, plan: LoadPlan) -> list[HeadPush]:
        """The pushes of the heads this rank holds, every group's."""
        engine = self.cache.engine
        return engine.head_pushes(plan.order.transfer, engine.placement.held(self.rank),
                                  self.rank)

    async def _load_push(self, client: ReceiverClient, plan: LoadPlan,
                         push: HeadPush, span: tracing.Span) -> None:
        copied: set[int] = set()
        source = self.cache.layout  # until the push's open says otherwise
        last = len(push.group.layer_names) - 1
        try:
            async for event in client.events(push.name, push.readers, opened=True):
                if isinstance(event, PushOpened):
                    span.add_event("push opened", {"kvwire.push": push.name})
                    source = self._opened(plan, event)
                elif isinstance(event, LayerLanded):
                    if event.layer in (0, last):
                        span.add_event("first layer landed" if event.layer == 0
                                       else "last layer landed", {"kvwire.push": push.name})
                    if event.offset is not None:
                        self._copy(plan, push, source, client.view(event), [event.layer],
                                   copied)
                else:
                    span.add_event("delivered", {"kvwire.push": push.name})
                    self._copy(plan, push, source, client.view(event),
                               range(len(push.group.layer_names)), copied)
        finally:
            # Released in every case: a slot not delivered yet is aborted (the
            # prefill side hears it), a delivered one goes back to the pool
            # (once its last reader let go). (Not opened at this receiver, or
            # the daemon is gone with it: nothing held.)
            with contextlib.suppress(KvwireError):
                await asyncio.shield(client.release(push.name))

    async def _discard(self, client: ReceiverClient, plan: LoadPlan,
                       pushes: list[HeadPush]) -> None:
        """A refused load's pushes, released as each opens (before its deadline):
        one still arriving is aborted, and the prefill side hears why."""
        async def discard(push: HeadPush) -> None:
            with contextlib.suppress(KvwireError, TimeoutError):
                async with asyncio.timeout(plan.order.wait):
                    async for _ in client.events(push.name, push.readers):
                        break
            with contextlib.suppress(KvwireError):
                await client.release(push.name)
        await asyncio.gather(*(discard(p) for p in pushes))

    def _opened(self, plan: LoadPlan, event: PushOpened) -> EngineLayout:
        """The layout the push was made in, from the prefill engine's note with its
        open, before any layer lands: this engine's, or this engine's at the
        prefill block size where the copy bridges the two. A layout this engine
        cannot read refuses the load now (the decode engine was asked before
        the prefill engine's answer announced it: the proxy's parallel flow);
        one announced in the answer was checked when the load was planned."""
        own = self.cache.layout
        if event.note is None:  # a prefill engine of an older release: the seals say
            return own
        prefill = EngineLayout.from_params(event.note, f"push {event.req}")
        differences = own.differences(prefill)
        if differences:
            raise LayoutMismatch(f"request {plan.req_id}: the prefill engine's KV layout "
                                 "differs from this engine's: " + "; ".join(differences))
        return own.with_block_size(prefill.block_size) if own.bridges(prefill) else own

    def _copy(self, plan: LoadPlan, push: HeadPush, source: EngineLayout, view: memoryview,
              layers: Iterable[int], copied: set[int]) -> None:
        """Layers' seals checked, then their blocks copied into vLLM's (regrouped
        when the prefill engine's block size, ``source``'s, differs): on the
        loop's thread, so a cancelled load cannot leave a copy running behind it."""
        group, span = push.group, plan.groups[push.group.index]
        count = len(group.layer_names)
        own_size = self.cache.block_size
        bridged = source.block_size != own_size
        head_bytes = group.head_bytes // own_size * source.block_size
        source_from = (pushed_from(plan.tokens, source.block_size, group.window) if bridged
                       else span.pushed_from)
        pushed = blocks_of(plan.tokens, source.block_size) - source_from
        size = layer_bytes(pushed, head_bytes)
        expected = LayerSeal(0, count, pushed, source.block_size, head_bytes,
                             transfer_hash(push.name), layout_fingerprint(source.key()), 0)
        if len(view) != size * count:
            self._check_prefill_layout(plan, view, count, expected)
            raise SealBroken(f"the push {push.name} is {len(view)} B; {count} layers of "
                             f"{size} B were expected (do both engines run the same model, "
                             "dtype and block size?)")
        # The blocks this engine fills, and where each lies in what is copied.
        positions = [(n, b) for n, b in enumerate(span.block_ids) if b != NULL_BLOCK]
        whole = len(positions) == len(span.block_ids)
        skip = 0 if bridged else span.load_from - span.pushed_from
        for n in layers:
            if n in copied:
                continue
            checked = check_layer(view[n * size : (n + 1) * size],
                                  dataclasses.replace(expected, layer=n))
            name = group.layer_names[n]
            kv: memoryview | np.ndarray = checked
            if bridged:  # this engine's blocks load_from .., regrouped from the push's
                index = _bridge_index(self.cache.token_map(source.block_size),
                                      self.cache.token_map(own_size), source_from, pushed,
                                      span.load_from, len(span.block_ids))
                kv = regroup(checked, self.cache.itemsize, index).reshape(-1)
            if whole:
                start = skip * group.head_bytes
                self.cache.write_head(name, push.head, span.block_ids,
                                      kv[start : start + len(positions) * group.head_bytes])
            else:
                for at, block in positions:
                    start = (skip + at) * group.head_bytes
                    self.cache.write_head(name, push.head, [block],
                                          kv[start : start + group.head_bytes])
            copied.add(n)

    @staticmethod
    def _check_prefill_layout(plan: LoadPlan, view: memoryview, layers: int,
                              expected: LayerSeal) -> None:
        """A push of another size than this engine expects, opened without a
        layout (not by kvwire's connector): the first layer's seal says what
        differs."""
        seal = _first_seal(view, layers)
        if seal is None:
            return
        differences = [f"{name}: prefill {getattr(seal, name)}, decode {getattr(expected, name)}"
                       for name in ("layers", "block_size", "block_bytes", "blocks")
                       if getattr(seal, name) != getattr(expected, name)]
        if differences:
            raise LayoutMismatch(f"request {plan.req_id}: the prefill engine's KV layout "
                                 "differs from this engine's: " + "; ".join(differences))

    def _bytes(self, plan: LoadPlan) -> int:
        """KV bytes a load wrote into this rank's cache."""
        return sum(len([b for b in span.block_ids if b != NULL_BLOCK]) * group.head_bytes
                   * len(group.layer_names) * group.local_heads
                   for group, span in zip(self.cache.engine.groups, plan.groups, strict=True))

    def _failed_load(self, plan: LoadPlan, exc: BaseException) -> None:
        reason = (exc.code if isinstance(exc, KvwireError)
                  else "deadline" if isinstance(exc, TimeoutError)
                  else "cancelled" if isinstance(exc, asyncio.CancelledError) else "error")
        if reason != "cancelled":
            self.counters.failed("load", reason)
            log.warning("kvwire: load of %s for request %s failed (%s): %s",
                        plan.order.transfer, plan.req_id, reason, exc or type(exc).__name__)
        with self._lock:
            self._failed_blocks.update(plan.block_ids)

    def cancel(self, req_ids: set[str]) -> None:
        """Requests vLLM finished (aborted) while their loads run: stop them."""
        with self._lock:
            for req_id in req_ids:
                self._kept.pop(req_id, None)

        def cancel_on_loop() -> None:
            for req_id in req_ids:
                task = self._tasks.get(req_id)
                if task is not None:
                    task.cancel()
        if req_ids:
            self.thread.loop.call_soon_threadsafe(cancel_on_loop)

    def wait_for_a_load(self, seconds: float) -> None:
        """In a step that computes nothing: until a load ends, at most
        ``seconds`` (kvwire_vllm.loads says why)."""
        self._loads.wait(seconds)

    def take_results(self) -> tuple[set[str], set[str]]:
        """Loads ended since the last call, and which of them failed."""
        finished, failed = self._loads.take()
        with self._lock:
            spans = [self._spans.pop(req_id) for req_id in finished if req_id in self._spans]
        for span in spans:  # vLLM hears now: the request may be scheduled
            span.end()
        return finished, failed

    def take_failed_blocks(self) -> set[int]:
        with self._lock:
            blocks, self._failed_blocks = self._failed_blocks, set()
            return blocks

    def close(self) -> None:
        async def disconnect() -> None:
            for task in list(self._tasks.values()):
                task.cancel()
            if self._discards:  # refused pushes that opened are released at once
                await asyncio.wait(set(self._discards), timeout=DISCARD_GRACE)
            await self._daemon.close()
        if self.thread.loop.is_running():
            self.thread.run(disconnect())
            self.thread.stop()


def _first_seal(view: memoryview, layers: int) -> LayerSeal | None:
    """The seal ending the first of ``layers`` equal layers in ``view``, if there is one."""
    if not layers or len(view) % layers or len(view) // layers < SEAL_BYTES:
        return None
    size = len(view) // layers
    try:
        return LayerSeal.unpack(view[size - SEAL_BYTES : size])
    except SealBroken:
        return None


@functools.lru_cache(maxsize=64)
def _bridge_index(source: TokenMap, dest: TokenMap, source_first: int, source_blocks: int,
                  dest_first: int, dest_blocks: int) -> Gather:
    """One gather per (block sizes, span of the prompt): the same for every
    layer and head of a load."""
    return plan_gather(regroup_index(source, dest, source_first, source_blocks, dest_first,
                                     dest_blocks))


def _first(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first failure in ``group`` (a TaskGroup's), nested groups opened."""
    first = group.exceptions[0]
    return _first(first) if isinstance(first, BaseExceptionGroup) else first
