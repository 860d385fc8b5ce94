"""The arithmetic of the experiments, kept apart so it can be checked by hand.

- Percentiles are nearest-rank: p99 of 1,000 samples is the 990th smallest,
  a value that was measured (and the convention perftest follows).
- The knee of a bandwidth curve is the smallest size reaching a fraction
  (90 %) of the peak: below it, per-descriptor cost rules; above it, the
  link does.
- Spread: a figure measured in rounds is their median, and its spread the
  lowest and highest round. A ratio whose spread is wider than its distance
  from 1 says less than its median alone suggests: the link drifted more
  between rounds than the two sides differ. The knee carries the sizes it
  could be, given each size's spread.
- Overlap: with compute Tc and transfer Tx per layer, running them one after
  the other costs Tc + Tx per layer, double-buffered max(Tc, Tx); the ideal
  speedup is (Tc + Tx) / max(Tc, Tx), at most 2, reached at the ridge point
  Tc = Tx. Left of it the deployment is network-bound (faster kernels are
  wasted), right of it compute-bound (a faster network is wasted). A link
  whose layers do not all take the same Tx lowers that ideal: each late
  layer stalls the compute waiting for its buffer, each early one idles the
  link, and the jitter ceiling says by how much on the measured link.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

KNEE_FRACTION = 0.9


def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile, ``q`` in [0, 100]: the smallest sample with at
    least ``q`` % of the samples at or below it (rank ceil(q/100 x n), at
    least 1). It is always a measured value: p50 of an even count is the
    lower of the two middle samples, and a p99 of fewer than 100 samples is
    the largest. kvwire prints every percentile (and every median) with this
    one, so a p99 does not depend on which command printed it."""
    if not samples:
        raise ValueError("no samples")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0..100")
    ordered = sorted(samples)
    # Rounded first: 99.9 / 100 * 1000 is 999.0000000000001 in floating point.
    rank = max(1, math.ceil(round(q * len(ordered) / 100, 9)))
    return ordered[rank - 1]


@dataclass(frozen=True)
class Latency:
    """Half round trips, in microseconds."""

    samples: int
    min_us: float
    p50_us: float
    p99_us: float
    p999_us: float
    mean_us: float


def half_rtt_latency(round_trips_s: Sequence[float]) -> Latency:
    half = [rtt / 2 * 1e6 for rtt in round_trips_s]
    return Latency(len(half), min(half), percentile(half, 50), percentile(half, 99),
                   percentile(half, 99.9), sum(half) / len(half))


def gbps(nbytes: float, seconds: float) -> float:
    return nbytes * 8 / seconds / 1e9 if seconds > 0 else 0.0


def knee(bandwidth: dict[int, float], fraction: float = KNEE_FRACTION) -> int | None:
    """The smallest size whose bandwidth reaches ``fraction`` of the peak."""
    if not bandwidth:
        return None
    peak = max(bandwidth.values())
    if peak <= 0:
        return None
    return min(size for size, bw in bandwidth.items() if bw >= fraction * peak)


def recommend_chunk(bandwidth: dict[int, float], layer_bytes: int) -> tuple[int | None, str]:
    """The streaming granularity to configure, and why.

    The knee, if it lies within a layer: chunks must not straddle layers, or
    a layer's notification waits for the next layer's compute. Otherwise a
    whole layer per write, the largest chunk that keeps per-layer events.
    """
    at_knee = knee(bandwidth)
    if at_knee is None:
        return None, "no bandwidth was measured"
    peak = max(bandwidth.values())
    if at_knee <= layer_bytes:
        return at_knee, (f"smallest size reaching {KNEE_FRACTION:.0%} of the "
                         f"{peak:.3g} Gb/s peak; smaller chunks pay per-descriptor cost")
    within = {s: bw for s, bw in bandwidth.items() if s <= layer_bytes}
    if not within:
        return at_knee, "no measured size fits in one layer"
    best = max(within, key=lambda s: (within[s], -s))
    return best, (f"the knee ({at_knee} B) is beyond one layer ({layer_bytes} B); "
                  f"this is the fastest size that keeps per-layer notification "
                  f"({within[best] / peak:.0%} of peak)")


def ratio(ours: float | None, theirs: float | None) -> float | None:
    if ours is None or theirs is None or theirs == 0:
        return None
    return ours / theirs


def ideal_speedup(compute_s: float, transfer_s: float, layers: int) -> float:
    """What double buffering can at best save over ``layers`` layers.

    Sequential is N (Tc + Tx). Overlapped, the first layer's compute and the
    last layer's transfer have nothing to hide behind: N max(Tc, Tx) +
    min(Tc, Tx). So the ideal tends to (Tc + Tx) / max(Tc, Tx), 2 at the
    ridge, only as N grows: 24 layers top out at 48 / 25 = 1.92.
    """
    longest, shortest = max(compute_s, transfer_s), min(compute_s, transfer_s)
    if longest <= 0 or layers < 1:
        return 1.0
    return layers * (compute_s + transfer_s) / (layers * longest + shortest)


def overlapped_seconds(compute_s: float, transfers: Sequence[float], buffers: int = 2) -> float:
    """An overlapped push on an engine that loses no time of its own.

    Layer n's compute starts once layer n - 1's is done and layer
    n - ``buffers`` is placed (its buffer is the one layer n reuses); the
    link carries one layer at a time, in order, each for its own
    ``transfers[n]``. The push ends when its last layer is placed. One buffer
    is the sequential schedule; with constant transfers and two or more it is
    ``ideal_speedup``'s N max(Tc, Tx) + min(Tc, Tx).
    """
    if buffers < 1:
        raise ValueError(f"overlap needs at least one buffer, got {buffers}")
    placed: list[float] = []
    computed = link_free = 0.0
    for n, transfer in enumerate(transfers):
        start = computed if n < buffers else max(computed, placed[n - buffers])
        computed = start + compute_s
        link_free = max(link_free, computed) + transfer
        placed.append(link_free)
    return placed[-1] if placed else 0.0


def jitter_ceiling(compute_s: float, transfer_samples: Sequence[float], layers: int,
                   buffers: int = 2, draws: int = 1000, seed: int = 0) -> float:
    """The best speedup ``buffers``-deep overlap can reach on a jittery link.

    ``ideal_speedup`` assumes every layer takes the same Tx. On a link whose
    layers take anything like ``transfer_samples``, a layer slower than Tc
    delays the compute waiting for its buffer, and a faster one leaves the
    link idle until the next layer is computed; neither is made up later.
    This is the median, over ``draws`` pushes of ``layers`` layers whose
    transfer times are drawn from the samples (with replacement, a fixed
    ``seed``, so a run's figure can be checked), of sequential over
    ``overlapped_seconds``: what a perfect engine would have measured.
    """
    if not transfer_samples or layers < 1:
        raise ValueError("a ceiling needs transfer samples and at least one layer")
    rng = random.Random(seed)
    speedups = []
    for _ in range(draws):
        transfers = rng.choices(transfer_samples, k=layers)
        overlapped = overlapped_seconds(compute_s, transfers, buffers)
        # A push with nothing to compute or move has nothing to overlap.
        speedups.append((layers * compute_s + sum(transfers)) / overlapped
                        if overlapped > 0 else 1.0)
    return statistics.median(speedups)


def efficiency(speedup: float, ideal: float) -> float:
    """Measured speedup over the ideal one (1.0: overlap hid all it could)."""
    return speedup / ideal if ideal > 0 else 0.0


def bound_side(compute_s: float, transfer_s: float) -> str:
    """Which side of the ridge (Tc = Tx) a deployment sits on."""
    if math.isclose(compute_s, transfer_s, rel_tol=0.05):
        return "balanced"
    return "network-bound" if compute_s < transfer_s else "compute-bound"


SIDE_MEANING = {
    "network-bound": "transfer outlasts compute: faster kernels are wasted, the link sets "
                     "the pace",
    "compute-bound": "compute outlasts transfer: a faster network is wasted, the kernels "
                     "set the pace",
    "balanced": "at the ridge: compute and transfer hide each other completely",
}


@dataclass(frozen=True)
class Spread:
    """A figure measured in rounds: the median, and the lowest and highest round.

    One round has no spread (``low`` and ``high`` are None): it says nothing
    about how steady the figure is.
    """

    median: float
    low: float | None = None
    high: float | None = None

    @property
    def width(self) -> float:
        return 0.0 if self.low is None or self.high is None else self.high - self.low

    def wider_than_effect(self, parity: float = 1.0) -> bool:
        """Whether the rounds disagree by more than the figure differs from
        ``parity``, or fall on both sides of it: read as a tendency at most."""
        if self.low is None or self.high is None:
            return False
        return self.low <= parity <= self.high or self.width > abs(self.median - parity)

    def to_wire(self) -> list[float] | None:
        return None if self.low is None or self.high is None else [self.low, self.high]


def spread(rounds: Sequence[float]) -> Spread | None:
    """The median and range of ``rounds``; None with no rounds at all."""
    if not rounds:
        return None
    if len(rounds) == 1:
        return Spread(float(rounds[0]))
    return Spread(float(statistics.median(rounds)), float(min(rounds)), float(max(rounds)))


def knee_range(rounds: Mapping[int, Sequence[float]],
               fraction: float = KNEE_FRACTION) -> tuple[int, int] | None:
    """The sizes the knee could be, within each size's rounds.

    The knee is the smallest size whose median reaches ``fraction`` of the
    highest median. It could be as early as the smallest size one of whose
    rounds reaches that line, and is surely reached by the smallest size all
    of whose rounds do (else by the knee itself).
    """
    medians = {size: statistics.median(r) for size, r in rounds.items() if r}
    at = knee(medians, fraction)
    if at is None:
        return None
    line = fraction * max(medians.values())
    earliest = min(size for size, r in rounds.items() if r and max(r) >= line)
    sure = [size for size, r in rounds.items() if r and min(r) >= line and size >= at]
    return min(earliest, at), min(sure) if sure else at
