"""Push KV caches through a local sender daemon and measure each push.

Used by ``kvctl push`` and by the demo. When a receiver socket is at hand
(same machine, or the two-namespace harness), the decode side is watched
too: the time until the first layer lands there, and a byte-for-byte check
of what arrived.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass

import numpy as np

from kvwired import checksum
from kvwired.client import Delivered, LayerLanded, ReceiverClient, SenderClient
from kvwired.errors import KvwireError
from kvwired.layout import KVLayout, RequestShape
from kvwired.units import format_size


class VerificationFailed(KvwireError, code="verification",
                         hint="the bytes differ from what was pushed: keep both logs and "
                              "report it"):
    """Delivered bytes differ from what was sent."""


@dataclass
class PushRecord:
    req: str
    chunk_bytes: int
    bytes: int
    writes: int
    seconds: float  # open() to delivered, as the engine saw it
    first_layer_seconds: float | None  # commit(0) to layer 0 seen by the decode engine
    checksum: int
    verified: bool | None
    # The engine's own copies into staging, within ``seconds``.
    write_seconds: float = 0.0
    # Written in full before the first commit (``staged``): ``seconds`` minus
    # ``write_seconds`` is then kvwire's time alone, with nothing overlapped.
    staged: bool = False

    @property
    def moved_seconds(self) -> float | None:
        """Open to delivered without the engine's writes (staged pushes only)."""
        return self.seconds - self.write_seconds if self.staged else None

    @property
    def gbps(self) -> float:
        return self.bytes * 8 / self.seconds / 1e9

    def row(self) -> list[object]:
        first = "-" if self.first_layer_seconds is None else f"{self.first_layer_seconds * 1e3:.2f}"
        verified = {None: "-", True: "yes", False: "NO"}[self.verified]
        return [self.req, format_size(self.chunk_bytes), self.writes,
                f"{self.seconds * 1e3:.1f}", f"{self.gbps:.2f}", first, verified]

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "gbps": self.gbps, "moved_seconds": self.moved_seconds}


HEADERS = ["request", "chunk", "writes", "total ms", "Gb/s", "first layer ms", "byte-exact"]


async def push_one(
    sender: SenderClient,
    peer: str | None,
    req: str,
    layout: RequestShape | KVLayout,
    data: np.ndarray,
    chunk: str | int | None = None,
    receiver: ReceiverClient | None = None,
    deadline: float | None = None,
    staged: bool = False,
) -> PushRecord:
    """Push ``data`` (uint8, the layout's total bytes long) as request ``req``.

    A named ``chunk`` resolves against ``layout``: give a ``KVLayout`` for the
    token granularities, a ``RequestShape`` knows its layers only. Layers are
    written and committed one by one, as a prefill engine produces them;
    ``staged`` writes them all first, then commits them all, so the record's
    ``moved_seconds`` is kvwire's part alone (as a plain socket loop's data
    is all in its buffer before it starts).
    """
    shape = layout.shape() if isinstance(layout, KVLayout) else layout
    raw = memoryview(data.reshape(-1).view(np.uint8).data)
    watcher: asyncio.Task[tuple[float | None, Delivered]] | None = None
    first_commit = time.perf_counter()
    if receiver is not None:
        receiver.subscribe(req)
        watcher = asyncio.create_task(_watch(receiver, req))
    try:
        push = await sender.open(req, peer, layout, chunk=chunk, deadline=deadline)
        write_seconds = 0.0
        for n in range(shape.layers):
            offset, length = shape.layer_span(n)
            started = time.perf_counter()
            push.layer(n)[:] = raw[offset : offset + length]
            write_seconds += time.perf_counter() - started
            if not staged:
                if n == 0:
                    first_commit = time.perf_counter()
                push.commit(n)
        if staged:
            first_commit = time.perf_counter()
            for n in range(shape.layers):
                push.commit(n)
        result = await push.finish()
    except BaseException:
        if watcher is not None:
            watcher.cancel()
        raise
    # The push's clock has stopped: checking every byte now, in a thread,
    # takes nothing from the figures (on a 2-core host a 48 MiB compare on
    # the event loop delayed ``finished`` by tens of milliseconds).
    expected = await asyncio.to_thread(checksum.of_buffer, raw, shape)
    if result.checksum != expected:
        raise VerificationFailed(
            f"request {req}: the receiver's checksum {result.checksum:#018x} is not the "
            f"sent data's {expected:#018x}")
    first_layer, verified = None, None
    if watcher is not None and receiver is not None:
        landed_at, delivered = await watcher
        first_layer = None if landed_at is None else landed_at - first_commit
        view = receiver.view(delivered)
        try:
            verified = await asyncio.to_thread(_same_bytes, view, raw)
        finally:
            view.release()
            await receiver.release(req)
        if not verified:
            raise VerificationFailed(f"request {req}: bytes at the receiver differ from those sent")
    return PushRecord(req, push.chunk_bytes, shape.total_bytes, int(result.timings["writes"]),
                      result.seconds, first_layer, result.checksum, verified,
                      write_seconds, staged)


def _same_bytes(got: memoryview, sent: memoryview) -> bool:
    # numpy compares at memory speed; memoryview's == goes item by item.
    return got.nbytes == sent.nbytes and bool(np.array_equal(
        np.frombuffer(got, dtype=np.uint8), np.frombuffer(sent, dtype=np.uint8)))


async def _watch(receiver: ReceiverClient, req: str) -> tuple[float | None, Delivered]:
    first: float | None = None
    async for event in receiver.events(req):
        if isinstance(event, LayerLanded):
            if first is None:
                first = time.perf_counter()
            continue
        return first, event
    raise AssertionError("unreachable: events() ends with Delivered")
