"""What per-lease keys cost: a grant and a revoke per lease, side by side with
the same 48 MiB push under one key for the whole region.

Runs over TCP anywhere and over verbs where an RDMA device is (in a lab node:
`kvctl lab exec prefill -- python benchmarks/lease_keys.py --transport verbs`).
One process, the real transport objects, two memories; pushes alternate
between the two modes so drift hits both alike. Reports the grant + revoke
time per lease and the 48 MiB push time in each mode, and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import uvloop

from kvwired.pool import SharedMemory
from kvwired.rdma import ROCE_V2, gid_table
from kvwired.transport import TransportOptions, make_transport
from kvwired.transport.base import DataChannel, Responder, Write

CACHE = 48 << 20
LAYER = 2 << 20


async def _connect(name: str, host: str, per_lease_keys: bool, source: SharedMemory,
                   target: SharedMemory) -> tuple[DataChannel, Responder]:
    initiator_side = make_transport(TransportOptions(name=name))
    responder_side = make_transport(TransportOptions(
        name=name, listen_host=host, listen_at_start=True, receive_depth=64,
        per_lease_keys=per_lease_keys))
    await initiator_side.start(source)
    await responder_side.start(target)
    responder = responder_side.responder(host, lambda imm: None, print)
    initiator = initiator_side.initiator(host)
    channel = await initiator.complete(await responder.accept(await initiator.offer()))
    return channel, responder


async def _push(channel: DataChannel, key: int | None) -> float:
    started = time.perf_counter()
    await asyncio.gather(*(channel.post([Write(n * LAYER, n * LAYER, LAYER)], imm=n, key=key)
                           for n in range(CACHE // LAYER)))
    return time.perf_counter() - started


async def _revoke(responder: Responder, key: int) -> None:
    revoked = asyncio.Event()
    responder.revoke(key, revoked.set)
    await revoked.wait()


async def main(name: str, rounds: int, leases: int) -> dict[str, float | str]:
    host = "127.0.0.1"
    if name == "verbs":
        host = next(e.ipv4 for e in gid_table() if e.type == ROCE_V2 and e.ipv4)
    memories = [SharedMemory(CACHE, f"bench-{n}") for n in range(4)]
    region, region_responder = await _connect(name, host, False, memories[0], memories[1])
    keyed, keyed_responder = await _connect(name, host, True, memories[2], memories[3])

    started = time.perf_counter()
    for _ in range(leases):
        await _revoke(keyed_responder, await keyed_responder.grant(0, CACHE))
    per_lease = (time.perf_counter() - started) / leases

    plain, with_keys = [], []
    for _ in range(rounds):
        plain.append(await _push(region, None))
        began = time.perf_counter()
        key = await keyed_responder.grant(0, CACHE)
        await _push(keyed, key)
        await _revoke(keyed_responder, key)
        with_keys.append(time.perf_counter() - began)
    for channel, responder in ((region, region_responder), (keyed, keyed_responder)):
        channel.close()
        responder.close()
    plain_s, keyed_s = statistics.median(plain), statistics.median(with_keys)
    return {"transport": name, "grant_and_revoke_us": per_lease * 1e6,
            "push_48mib_region_key_ms": plain_s * 1e3,
            "push_48mib_per_lease_key_ms": keyed_s * 1e3,
            "ratio": keyed_s / plain_s, "rounds": rounds}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", choices=["tcp", "verbs"], default="tcp")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--leases", type=int, default=200)
    args = parser.parse_args()
    print(json.dumps(uvloop.run(main(args.transport, args.rounds, args.leases)), indent=2))
