"""``kvctl demo netns``: the whole path between two hosts, in one command.

Builds two network namespaces, starts a receiver and a sender in them,
pushes a Qwen2.5-0.5B-shaped 48 MiB KV cache through the real client API at
every named granularity, checks every byte on the decode side, has the
daemons run a plain socket loop over the same link at the same sizes (the
baseline: ``sendall``/``recv_into``, nothing else), and prints what it
measured beside the baseline, the ratios, and what the daemons report. The
figures go to ``results/demo-netns.json``.
"""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, TextIO

from kvwired import analysis
from kvwired.client import ReceiverClient, SenderClient
from kvwired.layout import GRANULARITIES, KVLayout
from kvwired.units import format_size

from . import table
from .netns import two_hosts
from .push import HEADERS, PushRecord, push_one
from .source import synthetic
from .status import HEADERS as STATUS_HEADERS

LOOP_HEADERS = ["plain loop ms", "x loop"]


async def netns_demo(repeat: int = 3, out: TextIO = sys.stdout,
                     results: Path | None = Path("results")) -> list[PushRecord]:
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
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
            print(f"plain socket loop over the same link ({repeat} rounds per size) ...",
                  file=out, flush=True)
            loop = await prefill.run("socket-loop", {
                "peer": "decode", "sizes": [r.chunk_bytes for r in records],
                "bytes": layout.total_bytes, "rounds": repeat}, lambda msg: None)
        finally:
            await prefill.close()
            await decode.close()
        loop_seconds = {row["size"]: row["median_seconds"] for row in loop["rows"]}
        rows = [_with_loop(r, loop_seconds.get(r.chunk_bytes)) for r in records]
        print(f"\nmedian of {repeat} pushes per granularity (open -> every byte delivered "
              f"and verified), beside a plain socket loop moving the same bytes in the same "
              f"chunks (median of {repeat}):", file=out)
        print(table.render(HEADERS + LOOP_HEADERS,
                           [r.row() + _loop_cells(row) for r, row in zip(records, rows,
                                                                        strict=True)]),
              file=out)
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
    if results is not None:
        results.mkdir(parents=True, exist_ok=True)
        path = results / "demo-netns.json"
        path.write_text(json.dumps({
            "experiment": "demo-netns", "transport": "tcp", "link": "veth",
            "started": started, "repeat": repeat, "bytes": layout.total_bytes,
            "rows": rows, "socket_loop": loop}, indent=2) + "\n")
        print(f"\nfigures: {path}", file=out)
    return records


def _with_loop(record: PushRecord, loop_seconds: float | None) -> dict[str, Any]:
    """One granularity's figures, with the plain loop's and the ratio of times."""
    return {**record.to_dict(), "loop_seconds": loop_seconds,
            "time_ratio": analysis.ratio(record.seconds, loop_seconds)}


def _loop_cells(row: dict[str, Any]) -> list[object]:
    if row["loop_seconds"] is None:
        return ["-", "-"]
    return [f"{row['loop_seconds'] * 1e3:.1f}", f"{row['time_ratio']:.2f}"]
