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
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Iterable

from kvwired.client import LayerLanded, LoopThread, ReceiverClient
from kvwired.errors import KvwireError

from .cache import KVCacheBlocks
from .daemon_link import DaemonLink
from .params import ConnectorSettings
from .scheduling import LoadPlan
from .seal import LayerSeal, SealBroken, check_layer, layer_bytes, transfer_hash
from .stats import ConnectorCounters

log = logging.getLogger("vllm.kvwire.consumer")


class Consumer:
    def __init__(self, settings: ConnectorSettings, cache: KVCacheBlocks,
                 counters: ConnectorCounters) -> None:
        self.settings = settings
        self.cache = cache
        self.counters = counters
        self.thread = LoopThread()
        self._daemon = DaemonLink(lambda: ReceiverClient.connect(self.settings.receiver_socket))
        self._tasks: dict[str, asyncio.Task[None]] = {}  # touched on the loop only
        self._lock = threading.Lock()
        self._finished: set[str] = set()
        self._failed: set[str] = set()
        self._failed_blocks: set[int] = set()

    def begin_step(self, plans: list[LoadPlan]) -> None:
        for plan in plans:
            self.thread.submit(self._run(plan))

    async def _run(self, plan: LoadPlan) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks[plan.req_id] = task
        started = time.perf_counter()
        try:
            await self._load(plan)
        except (KvwireError, TimeoutError, asyncio.CancelledError) as exc:
            self._failed_load(plan, exc)
        except Exception as exc:  # a bug here must not leave the request waiting
            log.exception("kvwire: load of %s broke", plan.order.transfer)
            self._failed_load(plan, exc)
        else:
            blocks = len(plan.block_ids)
            self.counters.loaded(plan.tokens - plan.first * self.cache.block_size,
                                 blocks * self.cache.block_bytes * self.cache.layers,
                                 time.perf_counter() - started)
        finally:
            self._tasks.pop(plan.req_id, None)
            with self._lock:
                self._finished.add(plan.req_id)

    async def _load(self, plan: LoadPlan) -> None:
        """Each layer is checked and copied as it lands (while the prefill engine
        still computes the next ones); the load is done once every layer is
        copied and the receiver says the request is delivered."""
        transfer = plan.order.transfer
        client = await self._daemon.client()
        copied: set[int] = set()
        try:
            async with asyncio.timeout(plan.order.wait):
                async for event in client.events(transfer):
                    if isinstance(event, LayerLanded):
                        if event.offset is not None:
                            self._copy(plan, client.view(event), [event.layer], copied)
                    else:
                        self._copy(plan, client.view(event), range(self.cache.layers), copied)
        finally:
            # Released in every case: a slot not delivered yet is aborted (the
            # prefill side hears it), a delivered one goes back to the pool.
            # (Not opened at this receiver, or the daemon is gone with it: nothing held.)
            with contextlib.suppress(KvwireError):
                await asyncio.shield(client.release(transfer))

    def _copy(self, plan: LoadPlan, view: memoryview, layers: Iterable[int],
              copied: set[int]) -> None:
        """Layers' seals checked, then their blocks copied into vLLM's: on the
        loop's thread, so a cancelled load cannot leave a copy running behind
        it."""
        cache = self.cache
        size = layer_bytes(plan.total, cache.block_bytes)
        if len(view) != size * cache.layers:
            raise SealBroken(f"the push of {plan.order.transfer} is {len(view)} B; "
                             f"{cache.layers} layers of {size} B were expected (do both "
                             "engines run the same model, dtype and block size?)")
        expected = LayerSeal(0, cache.layers, plan.total, cache.block_size, cache.block_bytes,
                             transfer_hash(plan.order.transfer), cache.layout, 0)
        first = plan.first * cache.block_bytes
        end = first + len(plan.block_ids) * cache.block_bytes
        for n in layers:
            if n in copied:
                continue
            layer = view[n * size : (n + 1) * size]
            kv = check_layer(layer, dataclasses.replace(expected, layer=n))
            cache.write_blocks(n, plan.block_ids, kv[first:end])
            copied.add(n)

    def _failed_load(self, plan: LoadPlan, exc: BaseException) -> None:
        reason = (exc.code if isinstance(exc, KvwireError)
                  else "deadline" if isinstance(exc, TimeoutError)
                  else "cancelled" if isinstance(exc, asyncio.CancelledError) else "error")
        if reason != "cancelled":
            self.counters.failed("load", reason)
            log.warning("kvwire: load of %s for request %s failed (%s): %s",
                        plan.order.transfer, plan.req_id, reason, exc or type(exc).__name__)
        with self._lock:
            self._failed.add(plan.req_id)
            self._failed_blocks.update(plan.block_ids)

    def cancel(self, req_ids: set[str]) -> None:
        """Requests vLLM finished (aborted) while their loads run: stop them."""
        def cancel_on_loop() -> None:
            for req_id in req_ids:
                task = self._tasks.get(req_id)
                if task is not None:
                    task.cancel()
        if req_ids:
            self.thread.loop.call_soon_threadsafe(cancel_on_loop)

    def take_results(self) -> tuple[set[str], set[str]]:
        """Loads ended since the last call, and which of them failed."""
        with self._lock:
            finished, self._finished = self._finished, set()
            failed = self._failed & finished
            self._failed -= failed
            return finished, failed

    def take_failed_blocks(self) -> set[int]:
        with self._lock:
            blocks, self._failed_blocks = self._failed_blocks, set()
            return blocks

    def close(self) -> None:
        async def disconnect() -> None:
            for task in list(self._tasks.values()):
                task.cancel()
            await self._daemon.close()
        if self.thread.loop.is_running():
            self.thread.run(disconnect())
            self.thread.stop()
