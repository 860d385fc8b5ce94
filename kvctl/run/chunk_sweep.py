"""``kvctl run chunk-sweep``: ask the sender daemon to run it, show and keep the figures."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvwired import analysis
from kvwired.client import SenderClient
from kvwired.errors import KvwireError
from kvwired.protocol import Message
from kvwired.protocol import sender_local as prefill_api
from kvwired.units import format_size

from .. import plots, table
from ..figures import (
    NOISE_NOTE,
    cpu_lines,
    knee_certainty,
    number,
    ratio_spread,
    times,
    with_spread,
)
from ..progress import PhaseProgress
from . import results

# Sizes the closing summary quotes ratios at: a token of a layer, a token,
# a layer of the reference cache.
RATIO_SIZES = (512, 12 << 10, 2 << 20)


@dataclass
class SweepRun:
    params: dict[str, Any]
    started: str = field(default_factory=lambda: datetime.datetime.now(
        datetime.UTC).isoformat(timespec="seconds"))
    rows: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] | None = None
    error: KvwireError | None = None

    @property
    def complete(self) -> bool:
        return self.error is None and self.summary is not None

    def document(self) -> dict[str, Any]:
        return {"experiment": "chunk-sweep", "started": self.started, "params": self.params,
                "complete": self.complete,
                "error": None if self.error is None else self.error.to_wire(),
                "summary": self.summary, "ratios": ratios(self.rows), "rows": self.rows}


async def run_sweep(socket: str | None, params: dict[str, Any],
                    progress: PhaseProgress) -> SweepRun:
    run = SweepRun(params)

    def on_message(msg: Message) -> None:
        if isinstance(msg, prefill_api.Row):
            run.rows.append(dict(msg.row))
        elif isinstance(msg, prefill_api.Progress):
            progress.update(msg.phase, msg.done, msg.total)

    client = await SenderClient.connect(socket)
    try:
        with progress:
            run.summary = await client.run("chunk-sweep", params, on_message)
    except KvwireError as exc:
        run.error = exc
    finally:
        await client.close()
    return run


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """kvwire over its baseline per size, each the median of its rounds' own
    ratios with their spread (``<name>_spread``: lowest and highest round).
    perftest: latency (our p50 / ib_write_lat's typical) and streaming
    bandwidth (ours / ib_write_bw's), each round beside its perftest run;
    socket loop: the 48 MiB delivery's time over the loop round beside it."""
    out = []
    for row in rows:
        entry: dict[str, Any] = {"size": row["size"]}
        if "perftest_gbps" in row:
            with_spread(entry, "latency_ratio", row.get("latency_round_ratios") or [])
            with_spread(entry, "bandwidth_ratio", row.get("bandwidth_round_ratios") or [])
        elif "socket_seconds" in row and "deliver_seconds" in row:
            paired = zip(row.get("deliver_rounds") or [], row["socket_rounds"], strict=False)
            with_spread(entry, "delivery_time_ratio",
                        [r for ours, loop in paired if (r := analysis.ratio(ours, loop))])
        else:
            continue
        out.append(entry)
    return out


def render(run: SweepRun) -> str:
    perftest = any("perftest_gbps" in r for r in run.rows)
    headers = ["size", "p50 µs", "p99 µs", "p99.9 µs", "n", "stream Gb/s", "writes/s",
               "48 MiB ms"]
    socket = any("socket_seconds" in r for r in run.rows)
    if perftest:
        headers += ["pt lat µs", "pt Gb/s", "lat xpt", "bw xpt"]
    if socket:
        headers += ["loop 48 MiB ms", "48 MiB xloop"]
    body = []
    by_size = {entry["size"]: entry for entry in ratios(run.rows)}
    for r in run.rows:
        ratio = by_size.get(r["size"], {})
        line: list[object] = [format_size(r["size"])]
        if "lat_p50_us" in r:
            line += [f"{r['lat_p50_us']:.1f}", f"{r['lat_p99_us']:.1f}",
                     f"{r['lat_p999_us']:.1f}", r["lat_samples"]]
        else:  # beyond --latency-up-to
            line += ["-"] * 4
        line += [f"{r['stream_gbps']:.3f}", f"{r['stream_writes_per_s']:,.0f}",
                 f"{r['deliver_seconds'] * 1e3:.0f}" if "deliver_seconds" in r else "-"]
        if perftest:
            line += [number(r.get("perftest_lat_typical_us"), ".1f"),
                     number(r.get("perftest_gbps"), ".3f"),
                     _times(ratio.get("latency_ratio")), _times(ratio.get("bandwidth_ratio"))]
        if socket:
            line += [number(r["socket_seconds"] * 1e3 if "socket_seconds" in r else None,
                             ".0f"),
                     _times(ratio.get("delivery_time_ratio"))]
        body.append(line)
    lines = ["chunk-sweep: half round trip (WRITE_WITH_IMM ping-pong), streaming writes, "
             "and the 48 MiB cache delivered at each size", table.render(headers, body)]
    if any("stream_cpu_user_us_per_write" in r for r in run.rows):
        lines += ["", render_cpu(run.rows), ""]
    summary = run.summary
    if summary is not None:
        lines.append(f"transport {summary.get('transport')}, sender {summary['sender']} -> "
                     f"receiver {summary['peer']}")
        knee = summary["knee_bytes"]
        if knee is not None:
            lines.append(f"knee: {format_size(knee)} (smallest size reaching 90% of the "
                         f"{summary['peak_gbps']:.3f} Gb/s peak; {knee_certainty(summary)})")
        chunk = summary["recommended_chunk_bytes"]
        if chunk is not None:
            lines.append(f"recommended streaming chunk: {format_size(chunk)} — "
                         f"{summary['recommendation']}")
    quoted = [r for r in ratios(run.rows) if r["size"] in RATIO_SIZES]
    said = []
    if quoted and "latency_ratio" in quoted[0]:
        said = [f"{format_size(r['size'])}: latency {times(ratio_spread(r, 'latency_ratio'))}, "
                f"bandwidth {times(ratio_spread(r, 'bandwidth_ratio'))}" for r in quoted]
        lines.append("kvwire / perftest (median of rounds, lowest\N{EN DASH}highest): "
                     + "; ".join(said))
    elif quoted:
        said = [f"{format_size(r['size'])}: {times(ratio_spread(r, 'delivery_time_ratio'))}"
                for r in quoted]
        lines.append("kvwire delivery time / plain socket loop, 48 MiB (median of rounds, "
                     "lowest\N{EN DASH}highest): " + "; ".join(said))
    if any("within the spread" in text for text in said):
        lines.append(NOISE_NOTE)
    lines += cpu_lines(run.rows)
    if run.error is not None:
        lines.append(f"INCOMPLETE: {run.error.message} ({len(run.rows)} of "
                     f"{len(run.params.get('sizes') or []) or '?'} sizes measured)")
    return "\n".join(lines)


CPU_NOTE = ("user time is what a real NIC leaves to the host (posting and reaping); over "
            "verbs the system time is\nthe kernel's emulation of the wire (rdma_rxe), which "
            "a NIC does in hardware, and 'one core' (the rate\none core could post these "
            "writes at) counts user time only; over TCP the kernel's time is the\n"
            "transport's own and counts too. perftest busy-polls its completions: while it "
            "measures, its\nCPU is its wall time (pt µs/write: one over its write rate); "
            "CPU xpt: ours, as counted, over that.")


def render_cpu(rows: list[dict[str, Any]]) -> str:
    """The sender's CPU per streamed write, beside ib_write_bw's where it ran."""
    perftest = any("perftest_cpu_user_us_per_write" in r for r in rows)
    headers = ["size", "user µs/write", "sys µs/write", "user s/GiB", "one core Gb/s"]
    if perftest:
        headers += ["pt µs/write", "pt s/GiB", "CPU xpt"]
    body = []
    for r in rows:
        line: list[object] = [
            format_size(r["size"]), number(r["stream_cpu_user_us_per_write"], ".2f"),
            number(r["stream_cpu_system_us_per_write"], ".2f"),
            number(r["stream_cpu_user_s_per_gib"], ".3f"),
            number(r["stream_cpu_one_core_gbps"], ".1f")]
        if perftest:
            line += [number(r.get("perftest_cpu_user_us_per_write"), ".2f"),
                     number(r.get("perftest_cpu_user_s_per_gib"), ".3f"),
                     _times(r.get("cpu_ratio"))]
        body.append(line)
    return "\n".join(["the sender's CPU per streamed write (median of rounds):",
                      table.render(headers, body), CPU_NOTE])


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def write_outputs(run: SweepRun, out_dir: Path) -> list[Path]:
    paths = results.write(out_dir, "chunk-sweep", run.document(), run.rows)
    if not run.rows:
        return paths
    summary = run.summary or {}
    where = f"{summary.get('transport', '')} {summary.get('sender', '')} -> " \
            f"{summary.get('peer', '')}".strip()
    suffix = "" if run.complete else " (incomplete)"
    paths.append(plots.sweep_latency(run.rows, out_dir / "chunk-sweep-latency.png",
                                     f"Half round trip vs write size {where}{suffix}"))
    paths.append(plots.sweep_bandwidth(run.rows, out_dir / "chunk-sweep-bandwidth.png",
                                       f"Bandwidth vs write size {where}{suffix}",
                                       summary.get("knee_bytes"),
                                       summary.get("recommended_chunk_bytes"),
                                       summary.get("knee_range_bytes")))
    return paths
