"""``kvctl demo lab``: a 48 MiB KV cache over RDMA between two lab nodes.

Boots the lab (unless one is up), runs a receiver on ``decode`` and a sender
on ``prefill``, pushes the Qwen2.5-0.5B-shaped cache at every granularity
over verbs (Soft-RoCE) while ``kvctl consume`` checks every byte on the
decode node, then the same over TCP on the same wire, and ib_write_bw at the
same sizes: the figures side by side, as ratios.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any, TextIO

from kvwired.layout import GRANULARITIES, KVLayout
from kvwired.units import format_size

from .. import table
from . import machine, perftest
from .daemons import NodeDaemon, receiver_config, sender_config
from .machine import LabError, LabState, run_in

TCP_GRANULARITIES = ("per-token", "per-layer")


@dataclass
class Measured:
    transport: str
    granularity: str
    chunk_bytes: int
    writes: int
    seconds: float
    gbps: float
    byte_exact: bool


def _kvctl(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvctl", *args]


def _push_checked(state: LabState, transport: str, granularity: str, seed: int,
                  rx: NodeDaemon, tx: NodeDaemon) -> Measured:
    import threading

    req = f"demo-{transport}-{granularity}"
    consumed: list[tuple[int, str, str]] = []
    consumer = threading.Thread(target=lambda: consumed.append(run_in("decode", _kvctl(
        "consume", req, "--socket", rx.socket, "--expect-seed", str(seed), "--json",
        "--timeout", "300"), state=state)), daemon=True)
    consumer.start()
    code, out, err = run_in("prefill", _kvctl(
        "push", "--socket", tx.socket, "--peer", "decode", "--req", req, "--seed", str(seed),
        "--chunk", granularity, "--json"), state=state)
    consumer.join(320)
    if code != 0:
        raise LabError(f"push {req} failed: {err.strip()}")
    if not consumed or consumed[0][0] != 0:
        raise LabError(f"decode side of {req} failed: {consumed}")
    pushed: dict[str, Any] = json.loads(out.splitlines()[-1])
    received: dict[str, Any] = json.loads(consumed[0][1].splitlines()[-1])
    return Measured(transport, granularity, pushed["chunk_bytes"], pushed["writes"],
                    pushed["seconds"], pushed["gbps"],
                    bool(received["checksum_ok"] and received["bytes_ok"]))


def _run_transport(state: LabState, transport: str, granularities: tuple[str, ...],
                   out: TextIO) -> list[Measured]:
    rx = NodeDaemon("decode", "receiver", receiver_config(transport=transport), state)
    tx = NodeDaemon("prefill", "sender", sender_config(transport=transport), state)
    print(f"starting kvwired receiver (decode) and sender (prefill), transport {transport}",
          file=out, flush=True)
    rx.start()
    try:
        tx.start()
        results = []
        for n, granularity in enumerate(granularities):
            results.append(_push_checked(state, transport, granularity, n, rx, tx))
            print(f"  {transport:5} {granularity:20} {results[-1].gbps:.3f} Gb/s", file=out,
                  flush=True)
        return results
    finally:
        tx.stop()
        rx.stop()


def lab_demo(out: TextIO = sys.stdout) -> list[Measured]:
    state, health = machine.status()
    started_here = state is None or "up" not in health.values()
    if started_here:
        print("booting the two-node Soft-RoCE lab ...", file=out, flush=True)
        state = machine.up()
        print(f"lab up in {state.booted_seconds:.1f} s", file=out, flush=True)
    assert state is not None
    layout = KVLayout()
    try:
        measured = _run_transport(state, "verbs", GRANULARITIES, out)
        measured += _run_transport(state, "tcp", TCP_GRANULARITIES, out)
        print("ib_write_bw at the same sizes (perftest, same link) ...", file=out, flush=True)
        baseline = {size: perftest.write_bw(size, layout.total_bytes // size, state)
                    for size in (layout.token_bytes, layout.layer_bytes)}
    finally:
        if started_here:
            machine.down()
    _report(measured, baseline, out)
    return measured


def _report(measured: list[Measured], baseline: dict[int, perftest.BandwidthResult],
            out: TextIO) -> None:
    print("\n48 MiB Qwen2.5-0.5B KV cache, prefill node -> decode node, every byte checked:",
          file=out)
    print(table.render(
        ["transport", "granularity", "chunk", "writes", "total ms", "Gb/s", "byte-exact"],
        [[m.transport, m.granularity, format_size(m.chunk_bytes), m.writes,
          f"{m.seconds * 1e3:.0f}", f"{m.gbps:.3f}", "yes" if m.byte_exact else "NO"]
         for m in measured]), file=out)
    verbs = {m.chunk_bytes: m for m in measured if m.transport == "verbs"}
    tcp = {m.chunk_bytes: m for m in measured if m.transport == "tcp"}
    rows = []
    for size, perf in baseline.items():
        ours = verbs.get(size)
        if ours is None:
            continue
        tcp_ratio = f"{ours.gbps / tcp[size].gbps:.2f}" if size in tcp else "-"
        rows.append([format_size(size), f"{ours.gbps:.3f}", f"{perf.gbps:.3f}",
                     f"{ours.gbps / perf.gbps:.2f}", tcp_ratio])
    print("\nkvwire over verbs next to ib_write_bw on the same link, same run:", file=out)
    print(table.render(["chunk", "kvwire Gb/s", "ib_write_bw Gb/s", "kvwire / perftest",
                        "verbs / tcp"], rows), file=out)
    print("\nSoft-RoCE runs inside the emulated CPUs of the nodes: read the ratios, not the "
          "absolute figures.", file=out)
