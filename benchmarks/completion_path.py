"""What kvwire's verbs completion path costs: idle CPU and added latency.

Run inside a lab node (`kvctl lab exec prefill -- python benchmarks/completion_path.py`)
or on any host with an RDMA device. One process, two queue pairs on the same
device (loopback), the real kvwire transport objects:

- added latency: a 512 B write with immediate, post -> completion future
  resolved, waited for (a) the way the daemons wait, asleep in the event loop
  until the completion channel's descriptor wakes it, and (b) by
  busy-polling both CQs in a tight loop, which adds no wake-up but burns a
  core; (a) - (b) is what sleeping costs;
- idle CPU: the process's CPU time while the event loop sits idle for 10 s
  with both CQs armed, as a daemon does between requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import uvloop

from kvwired.analysis import percentile
from kvwired.pool import SharedMemory
from kvwired.rdma import gid_table
from kvwired.transport.base import Write
from kvwired.transport.verbs import VerbsTransport
from kvwired.transport.verbs.channel import VerbsDataChannel
from kvwired.transport.verbs.responder import VerbsResponder


async def main(iterations: int, idle_seconds: float, spin_us: float) -> dict[str, float]:
    address = next(e.ipv4 for e in gid_table() if e.type == "RoCE v2" and e.ipv4)
    assert address is not None
    source, target = SharedMemory(4 << 20, "bench-src"), SharedMemory(4 << 20, "bench-dst")
    initiator_side = VerbsTransport(spin_us=spin_us)
    responder_side = VerbsTransport(receive_depth=64, spin_us=spin_us)
    await initiator_side.start(source)
    await responder_side.start(target)
    immediates: list[int] = []
    responder = responder_side.responder(address, immediates.append, print)
    initiator = initiator_side.initiator(address)
    channel = await initiator.complete(await responder.accept(await initiator.offer()))
    write = [Write(0, 0, 512)]

    for _ in range(50):  # warm up
        await channel.post(write, imm=1)

    event_driven = []
    for _ in range(iterations):
        started = time.perf_counter()
        await channel.post(write, imm=1)
        event_driven.append(time.perf_counter() - started)

    assert isinstance(channel, VerbsDataChannel) and isinstance(responder, VerbsResponder)
    busy = []
    for _ in range(iterations):
        started = time.perf_counter()
        future = channel.post(write, imm=1)
        while not future.done():
            channel.poll_now()
            responder.poll_now()
        busy.append(time.perf_counter() - started)

    # Throughput: 48 MiB in 2 MiB writes, one post per 2 MiB, as a layer goes.
    started = time.perf_counter()
    cpu_started = time.process_time()
    await asyncio.gather(*(channel.post([Write(0, 0, 2 << 20)], imm=1) for _ in range(24)))
    stream_seconds = time.perf_counter() - started
    stream_cpu = (time.process_time() - cpu_started) / stream_seconds

    cpu_before, wall_before = time.process_time(), time.perf_counter()
    await asyncio.sleep(idle_seconds)
    idle_cpu = (time.process_time() - cpu_before) / (time.perf_counter() - wall_before)

    channel.close()
    responder.close()
    return {
        "iterations": iterations,
        "event_p50_us": percentile(event_driven, 50) * 1e6,
        "event_p99_us": percentile(event_driven, 99) * 1e6,
        "busy_p50_us": percentile(busy, 50) * 1e6,
        "busy_p99_us": percentile(busy, 99) * 1e6,
        "added_p50_us": (percentile(event_driven, 50) - percentile(busy, 50)) * 1e6,
        "idle_cpu_percent": idle_cpu * 100,
        "stream_48mib_gbps": (48 << 20) * 8 / stream_seconds / 1e9,
        "stream_cpu_percent": stream_cpu * 100,
        "spin_us": spin_us,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=500)
    parser.add_argument("--idle", type=float, default=10.0)
    parser.add_argument("--spin-us", type=float, default=0.0,
                        help="poll this long after activity before sleeping (0: never spin)")
    args = parser.parse_args()
    # The daemons run on uvloop; so does this measurement.
    print(json.dumps(uvloop.run(main(args.iterations, args.idle, args.spin_us)), indent=2))
