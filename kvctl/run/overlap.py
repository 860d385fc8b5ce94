"""``kvctl run overlap``: an emulated prefill engine on the real client API.

Layer compute is emulated by an event-loop timer of Tc (a GPU kernel keeps
the host CPU free, and so does a timer), while the event loop keeps talking
to the sender daemon. Per layer:

- sequential: compute layer n, commit it, wait until it is placed remotely;
- overlapped, double-buffered: before computing layer n, wait only until
  layer n - 2 is placed (its buffer is the one layer n reuses), so layer n
  is computed while layer n - 1 is on the wire. ``--buffers 3`` or more
  lets the compute run further ahead of a link that is late now and then.

A push is timed from its first compute to the moment its last layer is
placed at the receiver, which is when decode could start. T_x, the
transfer time of one layer, is measured first (sequential, no compute);
ratios Tc/Tx then set the compute time of each run. A link's T_x drifts
(the lab's by half within one run), so each pair of pushes (sequential,
then overlapped, same Tc) takes its Tc from the sequential push before it,
and each ratio's ideal is worked out on the T_x its own sequential pushes
saw. Those samples also give it a jitter ceiling: what a perfect engine
would reach on a link whose layers do not all take T_x
(``analysis.jitter_ceiling``).
"""

from __future__ import annotations

import asyncio
import datetime
import statistics
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvwired import analysis
from kvwired.client import OutgoingPush, SenderClient
from kvwired.errors import KvwireError, UsageError
from kvwired.experiments.plan import PlannedPhase
from kvwired.layout import RequestShape
from kvwired.units import format_size

from .. import plots, table
from ..figures import speedup_text
from ..progress import PhaseProgress
from . import results

DEFAULT_RATIOS = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)


@dataclass(frozen=True)
class OverlapParams:
    peer: str
    ratios: tuple[float, ...] = DEFAULT_RATIOS
    layers: int = 24
    layer_bytes: int = 2 << 20
    repeats: int = 3
    chunk: str | int | None = None
    layer_compute: float | None = None  # the deployment's own Tc per layer, seconds
    buffers: int = 2  # layer buffers the engine computes into (2: double-buffered)

    def __post_init__(self) -> None:
        if self.layers < 3:
            raise UsageError("overlap needs at least 3 layers to double-buffer")
        if self.layer_bytes < 1 or self.repeats < 1:
            raise UsageError("--layer-bytes and --repeats must be positive")
        if any(r < 0 for r in self.ratios) or not self.ratios:
            raise UsageError("--ratios must be non-negative numbers, e.g. 0,0.5,1,2")
        if not 2 <= self.buffers < self.layers:
            raise UsageError(f"--buffers must be 2 (double-buffered) up to {self.layers - 1} "
                             f"(fewer than --layers), got {self.buffers}")

    @property
    def shape(self) -> RequestShape:
        return RequestShape(self.layers, self.layer_bytes)

    def phases(self) -> list[PlannedPhase]:
        """T_x, then per ratio its pairs of pushes. Tc follows T_x, so a
        ratio's compute counts as that many more of the cache's bytes: a
        sequential push takes (1 + r) transfers, an overlapped one max(1, r)."""
        cache = self.shape.total_bytes
        writes = self.layers  # at least one per layer; the chunk is the sender's
        out = [PlannedPhase("T_x per layer", (self.repeats + 1) * writes,
                            (self.repeats + 1) * cache, self.repeats + 1)]
        for ratio in self.ratios:
            out.append(PlannedPhase(
                f"Tc/Tx = {ratio:g}", 2 * self.repeats * writes,
                int(self.repeats * cache * (1 + ratio + max(1.0, ratio))), 2 * self.repeats))
        return out


@dataclass
class OverlapRun:
    params: OverlapParams
    started: str = field(default_factory=lambda: datetime.datetime.now(
        datetime.UTC).isoformat(timespec="seconds"))
    transfer_s: float | None = None  # T_x per layer
    transfer_samples: list[float] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    error: KvwireError | None = None

    @property
    def complete(self) -> bool:
        return self.error is None and len(self.rows) == len(self.params.ratios)

    def summary(self) -> dict[str, Any]:
        tx = self.transfer_s
        out: dict[str, Any] = {"transfer_per_layer_s": tx, "ridge_ratio": 1.0,
                               "ridge_compute_per_layer_s": tx}
        if self.rows:
            best = max(self.rows, key=lambda r: r["speedup"])
            out.update(peak_speedup=best["speedup"],
                       peak_speedup_spread=best.get("speedup_spread"),
                       peak_speedup_ratio=best["ratio"],
                       peak_efficiency=best["efficiency"],
                       peak_ceiling_speedup=best["ceiling_speedup"])
        if tx and self.params.layer_compute is not None:
            side = analysis.bound_side(self.params.layer_compute, tx)
            out.update(deployment_compute_per_layer_s=self.params.layer_compute,
                       deployment_ratio=self.params.layer_compute / tx, deployment_side=side,
                       deployment_meaning=analysis.SIDE_MEANING[side])
        return out

    def document(self) -> dict[str, Any]:
        p = self.params
        return {"experiment": "overlap", "started": self.started,
                "params": {"peer": p.peer, "ratios": list(p.ratios), "layers": p.layers,
                           "layer_bytes": p.layer_bytes, "repeats": p.repeats,
                           "chunk": p.chunk, "layer_compute": p.layer_compute,
                           "buffers": p.buffers},
                "complete": self.complete,
                "error": None if self.error is None else self.error.to_wire(),
                "summary": self.summary(), "transfer_samples_s": self.transfer_samples,
                "rows": self.rows}


@dataclass
class _Timed:
    """One push as the emulated engine lived it."""

    seconds: float  # first compute to last layer placed
    # Waiting for a free buffer (layer n - buffers placed) before computing n:
    # at the ridge every late transfer shows here, as the link's share of the loss.
    stalled: float = 0.0
    # How much longer than Tc the compute took, summed over layers: the
    # engine's share (its timer's wake-up on a busy CPU).
    overshoot: float = 0.0


async def _compute(seconds: float, timed: _Timed) -> None:
    # A GPU's layer ends at a point on the clock and the engine hears of it
    # with one wake-up: an event-loop timer is that. A worker thread's sleep
    # added two hand-offs to the emulation itself: on the lab's one-CPU
    # nodes, beside an rxe that keeps the CPU busy, a layer overran Tc by
    # 5.0 ms (median) that way against 2.4 ms with the timer.
    if seconds > 0:
        started = time.perf_counter()
        await asyncio.sleep(seconds)
        timed.overshoot += max(0.0, time.perf_counter() - started - seconds)


async def _push_once(client: SenderClient, params: OverlapParams, overlapped: bool,
                     compute_s: float, transfer_samples: list[float] | None = None) -> _Timed:
    req = f"overlap-{uuid.uuid4().hex[:12]}"
    push: OutgoingPush = await client.open(req, params.peer, params.shape, chunk=params.chunk,
                                           discard=True)
    timed = _Timed(0.0)
    try:
        started = time.perf_counter()
        for n in range(params.layers):
            if overlapped and n >= params.buffers:
                waited = time.perf_counter()
                await push.wait_sent(n - params.buffers)  # the buffer layer n reuses is free
                timed.stalled += time.perf_counter() - waited
            await _compute(compute_s, timed)
            committed = time.perf_counter()
            push.commit(n)
            if not overlapped:
                await push.wait_sent(n)
                if transfer_samples is not None:
                    transfer_samples.append(time.perf_counter() - committed)
        await push.wait_sent(params.layers - 1)
        timed.seconds = time.perf_counter() - started
        await push.finish()
        return timed
    except BaseException:
        push.abort()
        raise


async def run_overlap(socket: str | None, params: OverlapParams,
                      progress: PhaseProgress) -> OverlapRun:
    run = OverlapRun(params)
    client = await SenderClient.connect(socket)
    try:
        with progress:
            await _measure(client, params, run, progress)
    except KvwireError as exc:
        run.error = exc
    finally:
        await client.close()
    return run


async def _measure(client: SenderClient, params: OverlapParams, run: OverlapRun,
                   progress: PhaseProgress) -> None:
    progress.update("T_x per layer", 0, params.repeats)
    await _push_once(client, params, False, 0.0)  # warm-up: connection, first lease
    for n in range(params.repeats):
        await _push_once(client, params, False, 0.0, run.transfer_samples)
        progress.update("T_x per layer", n + 1, params.repeats)
    tx = statistics.median(run.transfer_samples)
    run.transfer_s = tx
    for ratio in params.ratios:
        phase = f"Tc/Tx = {ratio:g}"
        progress.update(phase, 0, params.repeats)  # a phase is timed from its first report
        pairs: list[tuple[float, _Timed, _Timed]] = []
        during: list[float] = []  # T_x per layer, seen by this ratio's sequential pushes
        for n in range(params.repeats):
            # A link's T_x drifts over minutes (the lab's by half within one
            # run): Tc follows the latest sequential push's, so a ratio of 1
            # stays on the ridge. Each pair shares its Tc.
            tc = ratio * tx
            seen: list[float] = []
            sequential = await _push_once(client, params, False, tc, seen)
            overlapped = await _push_once(client, params, True, tc)
            pairs.append((tc, sequential, overlapped))
            during += seen
            tx = statistics.median(seen)
            progress.update(phase, n + 1, params.repeats)
        run.rows.append(_row(params, ratio, pairs, during))


def _row(params: OverlapParams, ratio: float, pairs: list[tuple[float, _Timed, _Timed]],
         during: list[float]) -> dict[str, Any]:
    """One ratio's figures; ideal and ceiling on the T_x its own pushes saw."""
    tc = statistics.median(pair[0] for pair in pairs)
    tx = statistics.median(during)
    sequential = [pair[1] for pair in pairs]
    overlapped = [pair[2] for pair in pairs]
    sequential_s = statistics.median(t.seconds for t in sequential)
    overlapped_s = statistics.median(t.seconds for t in overlapped)
    # Per pair, then the median: a pair's two pushes ran back to back with
    # one Tc, while the link may have drifted between pairs.
    pair_speedups = [s.seconds / o.seconds for _, s, o in pairs]
    speedup = statistics.median(pair_speedups)
    steadiness = analysis.spread(pair_speedups)
    ideal = analysis.ideal_speedup(tc, tx, params.layers)
    total_bytes = params.shape.total_bytes
    return {
        "ratio": ratio, "compute_per_layer_s": tc, "transfer_per_layer_s": tx,
        "ratio_as_run": tc / tx if tx > 0 else 0.0,
        "sequential_s": sequential_s, "overlapped_s": overlapped_s,
        "sequential_gbps": analysis.gbps(total_bytes, sequential_s),
        "overlapped_gbps": analysis.gbps(total_bytes, overlapped_s),
        "speedup": speedup, "speedup_spread": steadiness.to_wire() if steadiness else None,
        "pair_speedups": pair_speedups, "ideal_speedup": ideal,
        "efficiency": analysis.efficiency(speedup, ideal),
        "ceiling_speedup": analysis.jitter_ceiling(tc, during, params.layers, params.buffers),
        "side": analysis.bound_side(tc, tx),
        # Where an overlapped push lost time against the ideal, per push.
        "overlapped_stall_s": statistics.median(t.stalled for t in overlapped),
        "compute_overshoot_s": statistics.median(t.overshoot for t in sequential + overlapped),
        "compute_samples_s": [pair[0] for pair in pairs],
        "transfer_samples_s": during,
        "sequential_samples_s": [t.seconds for t in sequential],
        "overlapped_samples_s": [t.seconds for t in overlapped]}


def render(run: OverlapRun) -> str:
    p = run.params
    lines = [f"overlap: {p.layers} layers x {format_size(p.layer_bytes)} "
             f"({format_size(p.shape.total_bytes)}), {p.buffers} buffers, compute emulated, "
             f"median of {p.repeats}"]
    if run.transfer_s is not None:
        lines.append(f"T_x per layer: {run.transfer_s * 1e3:.2f} ms "
                     f"({analysis.gbps(p.layer_bytes, run.transfer_s):.3f} Gb/s) at the start; "
                     "Tc follows it as it drifts, Tx ms is what each ratio's pushes saw")
    lines.append(table.render(
        ["Tc/Tx", "Tc ms", "Tx ms", "sequential ms", "overlapped ms", "seq Gb/s", "ovl Gb/s",
         "speedup", "pairs", "ideal", "ceiling", "efficiency", "side", "stall ms",
         "overshoot ms"],
        [[f"{r['ratio']:g}", f"{r['compute_per_layer_s'] * 1e3:.2f}",
          f"{r['transfer_per_layer_s'] * 1e3:.2f}",
          f"{r['sequential_s'] * 1e3:.1f}", f"{r['overlapped_s'] * 1e3:.1f}",
          f"{r['sequential_gbps']:.3f}", f"{r['overlapped_gbps']:.3f}", f"{r['speedup']:.2f}",
          _pairs(r.get("speedup_spread")), f"{r['ideal_speedup']:.2f}",
          f"{r['ceiling_speedup']:.2f}", f"{r['efficiency']:.0%}",
          r["side"],
          f"{r['overlapped_stall_s'] * 1e3:.0f}", f"{r['compute_overshoot_s'] * 1e3:.0f}"]
         for r in run.rows]))
    if run.rows:
        lines.append("ideal and ceiling are worked out on Tx ms; "
                     "ceiling: the ideal on this link's own T_x spread (a perfect engine); "
                     "stall: an overlapped push's wait for a free buffer (the link ran late); "
                     "overshoot: compute beyond Tc (the engine ran late); per push, medians; "
                     "pairs: the lowest and highest speedup of the pairs of pushes")
    summary = run.summary()
    if "peak_speedup" in summary:
        lines.append(f"peak speedup {speedup_text(summary)} at Tc/Tx = "
                     f"{summary['peak_speedup_ratio']:g} "
                     f"({summary['peak_efficiency']:.0%} of ideal; this link's ceiling "
                     f"{summary['peak_ceiling_speedup']:.2f})")
    if run.transfer_s is not None:
        lines.append(f"ridge point: Tc = Tx = {run.transfer_s * 1e3:.2f} ms per layer; below "
                     "it the link sets the pace, above it compute does")
    if "deployment_side" in summary:
        lines.append(f"this deployment: Tc {summary['deployment_compute_per_layer_s'] * 1e3:.2f}"
                     f" ms per layer = {summary['deployment_ratio']:.2g} x Tx: "
                     f"{summary['deployment_side']} — {summary['deployment_meaning']}")
    elif run.transfer_s is not None:
        lines.append("give --layer-compute (your prefill's time per layer) to place your "
                     "deployment against the ridge")
    if run.error is not None:
        lines.append(f"INCOMPLETE: {run.error.message} ({len(run.rows)} of "
                     f"{len(p.ratios)} ratios measured)")
    return "\n".join(lines)


def _pairs(bounds: list[float] | None) -> str:
    return "-" if not bounds else f"{bounds[0]:.2f}\N{EN DASH}{bounds[1]:.2f}"


def write_outputs(run: OverlapRun, out_dir: Path) -> list[Path]:
    paths = results.write(out_dir, "overlap", run.document(), run.rows)
    if not run.rows:
        return paths
    suffix = "" if run.complete else " (incomplete)"
    summary = run.summary()
    paths.append(plots.overlap_speedup(
        run.rows, out_dir / "overlap-speedup.png",
        f"Overlap with {run.params.buffers} buffers vs Tc/Tx{suffix}",
        summary.get("deployment_ratio")))
    paths.append(plots.overlap_bandwidth(
        run.rows, out_dir / "overlap-bandwidth.png",
        f"Effective bandwidth, sequential vs overlapped{suffix}"))
    return paths
