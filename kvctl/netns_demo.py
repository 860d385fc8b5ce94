"""``kvctl demo netns``: the whole path between two hosts, in one command.

Builds two network namespaces, starts a receiver and a sender in them,
pushes a Qwen2.5-0.5B-shaped 48 MiB KV cache through the real client API at
every named granularity, checks every byte on the decode side, and prints
what it measured and what the daemons report.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TextIO

from kvwired.client import ReceiverClient, SenderClient
from kvwired.layout import GRANULARITIES, KVLayout
from kvwired.units import format_size

from . import table
from .netns import two_hosts
from .push import HEADERS, PushRecord, push_one
from .source import synthetic
from .status import HEADERS as STATUS_HEADERS


async def netns_demo(repeat: int = 3, out: TextIO = sys.stdout) -> list[PushRecord]:
    layout = KVLayout()
    data = synthetic(layout)
    print(f"KV cache: {layout.layers} layers x {layout.tokens} tokens x {layout.kv_heads} KV "
          f"heads x head dim {layout.head_dim}, {layout.dtype}, K and V = "
          f"{format_size(layout.total_bytes)}", file=out)
    records: list[PushRecord] = []
    with tempfile.TemporaryDirectory(prefix="kvwire-demo-") as tmp, \
            two_hosts(Path(tmp)) as (pair, receiver, sender):
        print(f"hosts: prefill {pair.prefill.address} ({pair.prefill.netns}) -> decode "
              f"{pair.decode.address} ({pair.decode.netns}), transport tcp over veth", file=out)
        prefill = await SenderClient.connect(sender.socket)
        decode = await ReceiverClient.connect(receiver.socket)
        try:
            for granularity in GRANULARITIES:
                runs = [await push_one(prefill, "decode", f"demo-{granularity}-{n}", layout,
                                       data, chunk=granularity, receiver=decode)
                        for n in range(repeat)]
                median = sorted(runs, key=lambda r: r.seconds)[len(runs) // 2]
                median.req = granularity
                records.append(median)
        finally:
            await prefill.close()
            await decode.close()
        print(f"\nmedian of {repeat} pushes per granularity (open -> every byte delivered "
              f"and verified):", file=out)
        print(table.render(HEADERS, [r.row() for r in records]), file=out)
        fastest = max(records, key=lambda r: r.gbps)
        soonest = min(records, key=lambda r: r.first_layer_seconds or float("inf"))
        print(f"\nhighest throughput: {fastest.req} ({fastest.gbps:.2f} Gb/s); first layer "
              f"soonest at the decode side: {soonest.req} "
              f"({(soonest.first_layer_seconds or 0) * 1e3:.2f} ms)\n", file=out)
        statuses = []
        for host, url in ((pair.prefill, f"{pair.prefill.address}:9472"),
                          (pair.decode, f"{pair.decode.address}:9471")):
            # Each daemon's metrics live in its own namespace: ask from inside it.
            result = subprocess.run(
                pair.argv(host, [sys.executable, "-m", "kvctl", "status", "--json", url]),
                capture_output=True, text=True, check=False)
            statuses += json.loads(result.stdout or "[]")
        print(table.render(STATUS_HEADERS, [list(s["row"].values()) for s in statuses]),
              file=out)
    return records
