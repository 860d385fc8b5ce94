"""``kvctl consume``: a stand-in decode engine on the receiver's node.

It subscribes to requests, times their layers as they land, checks what
arrived (the receiver's checksum; with ``--file`` or ``--expect-seed``,
every byte against the file or the synthetic cache ``kvctl push`` sent),
and releases them.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass

import numpy as np

from kvwired import checksum
from kvwired.client import Delivered, LayerLanded, ReceiverClient
from kvwired.errors import KvwireError


@dataclass
class ConsumeRecord:
    req: str
    bytes: int
    layers: int
    first_layer_at: float  # seconds after subscribing
    delivered_at: float
    checksum_ok: bool
    bytes_ok: bool | None  # None: nothing to compare with

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


async def consume_one(client: ReceiverClient, req: str, expected: np.ndarray | None,
                      timeout: float | None, keep: bool = False) -> ConsumeRecord:
    started = time.perf_counter()
    first: float | None = None
    delivered: Delivered | None = None
    async with asyncio.timeout(timeout):
        async for event in client.events(req):
            if isinstance(event, LayerLanded) and first is None:
                first = time.perf_counter() - started
            elif isinstance(event, Delivered):
                delivered = event
    assert delivered is not None
    view = client.view(delivered)
    try:
        checksum_ok = checksum.of_buffer(view, delivered.shape) == delivered.checksum
        bytes_ok = None
        if expected is not None:
            raw = expected.reshape(-1).view(np.uint8)
            bytes_ok = raw.nbytes == delivered.length and view == raw.data
    finally:
        view.release()
    if keep:
        await client.unsubscribe(req)  # left for the decode engine that comes next
    else:
        await client.release(req)
    return ConsumeRecord(req, delivered.length, delivered.layers,
                         first if first is not None else 0.0,
                         time.perf_counter() - started, checksum_ok, bytes_ok)


async def consume(socket_path: str, requests: list[str], expected: np.ndarray | None,
                  timeout: float | None, keep: bool = False) -> list[ConsumeRecord]:
    """Wait for every request at once; raise the first failure."""
    client = await ReceiverClient.connect(socket_path)
    try:
        for req in requests:
            client.subscribe(req)
        results = await asyncio.gather(
            *(consume_one(client, req, expected, timeout, keep) for req in requests),
            return_exceptions=True)
    finally:
        await client.close()
    for result in results:
        if isinstance(result, BaseException):
            if isinstance(result, TimeoutError):
                raise KvwireError(f"not every request arrived within {timeout:g} s",
                                  hint="is the sender pushing to this receiver?")
            raise result
    return [r for r in results if isinstance(r, ConsumeRecord)]
