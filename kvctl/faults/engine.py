"""The fault campaign's engines: a prefill engine and a decode engine, each a
process of its own, so a scenario can SIGKILL either at a chosen point.

    python -m kvctl.faults.engine prefill --socket S --req R --seed N [--hold PHASE]
    python -m kvctl.faults.engine decode  --socket S --req R --seed N [--hold PHASE]

Each prints one JSON object a line as it goes (``{"e": "opened"}``,
``{"e": "layer", "n": 3}``, ...) and ends with ``finished``, ``verified`` or
``failed``. ``--hold PHASE`` (repeatable) makes it stop there and wait for a line
on stdin (or, with ``--release-dir``, for a file named after the phase to
appear there: a lab node's commands have no stdin), so the campaign injects
its fault exactly there. The decode engine
compares every byte it was delivered with the cache the prefill engine
sends (the same seed), and counts the bytes that differ.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvwired.client import Delivered, LayerLanded, ReceiverClient, SenderClient
from kvwired.errors import KvwireError
from kvwired.layout import RequestShape

from ..source import synthetic_bytes

PREFILL_PHASES = ("connected", "opened", "half", "committed", "finished")
DECODE_PHASES = ("subscribed", "first-layer", "verified", "released")


def corrupt_bytes(got: memoryview, expected: np.ndarray) -> int:
    """How many bytes differ from what was sent (a wrong length: all of them)."""
    delivered = np.frombuffer(got, dtype=np.uint8)
    if delivered.size != expected.size:
        return max(delivered.size, expected.size)
    return int(np.count_nonzero(delivered != expected))


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"e": event, "t": time.monotonic(), **fields}), flush=True)


def failure(exc: BaseException) -> dict[str, Any]:
    """How an error surfaced: typed (a KvwireError subclass) or not."""
    typed = isinstance(exc, KvwireError) and type(exc) is not KvwireError
    return {"class": type(exc).__name__, "typed": typed, "message": str(exc)[:300]}


RELEASE_POLL = 0.05  # a look at the release directory (9p in the lab) costs CPU


async def wait_released(phase: str, release_dir: str | None) -> None:
    if release_dir is None:
        await asyncio.to_thread(sys.stdin.readline)
        return
    released = Path(release_dir) / phase
    while not released.exists():
        await asyncio.sleep(RELEASE_POLL)


async def hold(phase: str, args: argparse.Namespace) -> None:
    emit(phase)
    if phase in (args.hold or ()):
        await wait_released(phase, args.release_dir)


async def prefill(args: argparse.Namespace) -> None:
    shape = RequestShape(args.layers, args.layer_bytes)
    data = synthetic_bytes(shape.total_bytes, args.seed)
    started = time.monotonic()
    async with await SenderClient.connect(args.socket) as client:
        await hold("connected", args)
        push = await client.open(args.req, args.peer, shape, chunk=args.chunk,
                                 deadline=args.deadline)
        await hold("opened", args)
        for n in range(shape.layers):
            offset, length = shape.layer_span(n)
            push.layer(n)[:] = data[offset : offset + length]
            push.commit(n)
            if n == shape.layers // 2 - 1:
                await hold("half", args)
            if args.layer_interval:
                await asyncio.sleep(args.layer_interval)  # the engine's compute, emulated
        await hold("committed", args)
        if args.give_up_after is None:
            result = await push.finish()
        else:
            # As an asyncio engine stops waiting: then it aborts, and still
            # learns how the request ended (aborted, or delivered first).
            try:
                result = await asyncio.wait_for(push.finish(), args.give_up_after)
            except TimeoutError:
                emit("gave-up")
                push.abort()
                result = await push.finish()
        emit("finished", seconds=time.monotonic() - started, checksum=result.checksum)


async def decode(args: argparse.Namespace) -> None:
    shape = RequestShape(args.layers, args.layer_bytes)
    expected = np.frombuffer(synthetic_bytes(shape.total_bytes, args.seed), dtype=np.uint8)
    async with await ReceiverClient.connect(args.socket) as client:
        client.subscribe(args.req)
        await hold("subscribed", args)
        async for event in client.events(args.req):
            if isinstance(event, LayerLanded) and event.layer == 0:
                await hold("first-layer", args)
            elif isinstance(event, Delivered):
                corrupt = corrupt_bytes(client.view(event), expected)
                emit("verified", corrupt=corrupt, bytes=event.length)
                if "verified" in (args.hold or ()):
                    await wait_released("verified", args.release_dir)
        await client.release(args.req)
        emit("released")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvctl.faults.engine")
    parser.add_argument("role", choices=["prefill", "decode"])
    parser.add_argument("--socket", required=True)
    parser.add_argument("--req", required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--peer")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--layer-bytes", type=int, default=2 << 20)
    parser.add_argument("--chunk", default="per-layer")
    parser.add_argument("--deadline", type=float)
    parser.add_argument("--layer-interval", type=float, default=0.0)
    parser.add_argument("--give-up-after", type=float,
                        help="wait this long on finish(), then abort and wait for the verdict")
    parser.add_argument("--hold", action="append", choices=[*PREFILL_PHASES, *DECODE_PHASES],
                        help="wait at this phase until released (repeatable)")
    parser.add_argument("--release-dir", help="wait for DIR/PHASE instead of a line on stdin")
    args = parser.parse_args(argv)
    emit("pid", pid=os.getpid())
    try:
        asyncio.run(prefill(args) if args.role == "prefill" else decode(args))
    except Exception as exc:  # every way out is reported, typed or not
        emit("failed", **failure(exc))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
