"""What an experiment will do, phase by phase, and how long what is left takes.

An experiment's parameters fix its phases before it starts: per size the
pings, the streamed writes, the perftest runs, the 48 MiB delivery. Each
planned phase counts its work in units whose costs a link decides: streamed
writes (per-descriptor cost) and their bytes (bandwidth), round trips (each
waits for the one before: latency) and the bytes they exchange, and
start-ups (a perftest process, a request's lease). The estimate fits those
costs to the phases already finished, so it needs no guess at the link's
speed: after the first small-size phases it knows what a write and a round
trip cost, after the larger ones what a byte does.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PlannedPhase:
    phase: str  # as progress names it ("stream 2 MiB")
    writes: int = 0  # streamed: back to back, the link kept busy
    bytes: int = 0  # moved by the streamed writes
    startups: int = 0  # a perftest process, a request's lease, a daemon's restart
    round_trips: int = 0  # ping-pongs: each waits for the one before
    exchanged: int = 0  # bytes moved by the round trips, one way at a time

    def units(self) -> tuple[float, ...]:
        return (float(self.writes), float(self.bytes), float(self.startups),
                float(self.round_trips), float(self.exchanged))


def merged(phases: Sequence[PlannedPhase]) -> list[PlannedPhase]:
    """Adjacent phases of one name as one: progress sees a name continue, not
    a new phase (two streaming rounds back to back are one "stream" line)."""
    out: list[PlannedPhase] = []
    for phase in phases:
        if out and out[-1].phase == phase.phase:
            last = out.pop()
            phase = PlannedPhase(phase.phase, *(int(a + b) for a, b in
                                                zip(last.units(), phase.units(), strict=True)))
        out.append(phase)
    return out


def _solve(rows: Sequence[tuple[float, ...]], times: Sequence[float],
           columns: Sequence[int]) -> list[float] | None:
    """Least squares over ``columns`` only; None if they cannot be told apart.

    Each column is scaled to its largest value first: bytes run to 1e8 where
    start-ups are 1, and unscaled normal equations would lose the small ones.
    """
    scale = [max(abs(r[c]) for r in rows) or 1.0 for c in columns]
    x = [[r[c] / s for c, s in zip(columns, scale, strict=True)] for r in rows]
    n = len(columns)
    a = [[sum(r[i] * r[j] for r in x) for j in range(n)] for i in range(n)]
    b = [sum(r[i] * t for r, t in zip(x, times, strict=True)) for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-9:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        b[col], b[pivot] = b[pivot], b[col]
        for other in range(n):
            if other != col:
                factor = a[other][col] / a[col][col]
                a[other] = [p - factor * q for p, q in zip(a[other], a[col], strict=True)]
                b[other] -= factor * b[col]
    return [b[i] / a[i][i] / scale[i] for i in range(n)]


# A phase's time is never measured better than this (scheduling, the link's
# drift): fits closer than it are not told apart, and the simpler one wins.
NOISE = 0.05
RECENT = 15  # phases: a finished phase weighs half as much this many phases later


def fit_costs(rows: Sequence[tuple[float, ...]], times: Sequence[float],
              weights: Sequence[float] | None = None) -> tuple[float, ...]:
    """Non-negative seconds per unit that best explain ``times``.

    Every subset of the units is tried and each fit with no negative cost is
    scored as Akaike's criterion does: how far it misses, floored at the
    timing noise, plus two for each unit it uses. A unit earns its place
    only by explaining what the others cannot: with the first phases of a
    sweep all costs could be told many ways, and a fit that read a round
    trip's wait as the cost of its bytes would foresee hours. Units no
    finished phase used stay 0.
    """
    if weights is not None:  # weighted least squares: each row and time by sqrt(weight)
        roots = [math.sqrt(w) for w in weights]
        rows = [tuple(u * root for u in r) for r, root in zip(rows, roots, strict=True)]
        times = [t * root for t, root in zip(times, roots, strict=True)]
    width = len(rows[0]) if rows else 0
    n = len(rows)
    mean = sum(times) / n if n else 0.0
    floor = n * (NOISE * mean) ** 2 or 1e-18
    best: tuple[float, tuple[float, ...]] | None = None
    for size in range(1, width + 1):
        for columns in itertools.combinations(range(width), size):
            if not all(any(r[c] for r in rows) for c in columns):
                continue
            solved = _solve(rows, times, columns)
            if solved is None or min(solved) < 0:
                continue
            costs = [0.0] * width
            for column, cost in zip(columns, solved, strict=True):
                costs[column] = cost
            residual = sum((sum(c * u for c, u in zip(costs, r, strict=True)) - t) ** 2
                           for r, t in zip(rows, times, strict=True))
            score = n * math.log(max(residual, floor) / n) + 2 * size
            if best is None or score < best[0] - 1e-9:
                best = (score, tuple(costs))
    return best[1] if best is not None else (0.0,) * width


@dataclass
class Estimate:
    """Follows progress through a plan; says how much of it is left, in seconds."""

    plan: Sequence[PlannedPhase]
    position: int = -1  # the phase running now
    finished: list[tuple[PlannedPhase, float]] = field(default_factory=list)

    def begin(self, phase: str) -> None:
        """``phase`` started: the next planned phase of that name (plans repeat names)."""
        for index in range(self.position + 1, len(self.plan)):
            if self.plan[index].phase == phase:
                self.position = index
                return

    def finish(self, seconds: float) -> None:
        """The running phase ended after ``seconds``."""
        if 0 <= self.position < len(self.plan):
            self.finished.append((self.plan[self.position], seconds))

    @property
    def phases(self) -> int:
        return len(self.plan)

    def remaining(self, fraction_done: float = 0.0) -> float | None:
        """Seconds left: the running phase's rest and every phase after it.

        None until a few finished phases have shown what the link's units cost.
        """
        if len(self.finished) < max(1, min(3, len(self.plan) // 3)) or self.position < 0:
            return None
        # Recent phases weigh more: the sizes ahead are nearer theirs than the
        # first ones', and a link drifts.
        n = len(self.finished)
        costs = fit_costs([p.units() for p, _ in self.finished],
                          [seconds for _, seconds in self.finished],
                          [0.5 ** ((n - 1 - i) / RECENT) for i in range(n)])
        if not any(costs):
            return None

        def predicted(phase: PlannedPhase) -> float:
            return sum(c * u for c, u in zip(costs, phase.units(), strict=True))

        now = self.plan[self.position] if self.position < len(self.plan) else None
        left = sum(predicted(p) for p in self.plan[self.position + 1:])
        if now is not None:
            left += predicted(now) * max(0.0, 1.0 - fraction_done)
        return left
