"""What an experiment will do, phase by phase, and how long what is left takes.

An experiment's parameters fix its phases before it starts: per size the
pings, the streamed writes, the perftest runs, the 48 MiB delivery. Each
planned phase counts its work in four units whose costs a link decides:
writes (per-descriptor cost), bytes streamed (bandwidth), bytes exchanged
by round trips (one way at a time: latency), and start-ups (a perftest
process, a request's lease). The estimate fits those costs to the phases
already finished, so it needs no guess at the link's speed: after the first
small-size phases it knows the per-write cost, after the larger ones the
per-byte costs.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PlannedPhase:
    phase: str  # as progress names it ("stream 2 MiB")
    writes: int = 0
    bytes: int = 0  # streamed: writes back to back, the link kept busy
    startups: int = 0
    # Moved by round trips, one way at a time: a byte costs more than streamed.
    exchanged: int = 0

    def units(self) -> tuple[float, float, float, float]:
        return (float(self.writes), float(self.bytes), float(self.startups),
                float(self.exchanged))


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


def fit_costs(rows: Sequence[tuple[float, ...]], times: Sequence[float]) -> tuple[float, ...]:
    """Non-negative seconds per unit that best explain ``times``.

    Every subset of the units is tried (four units: fifteen fits) and the
    best fit with no negative cost wins; units no finished phase used stay 0.
    """
    width = len(rows[0]) if rows else 0
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
            if best is None or residual < best[0] * (1 - 1e-9):
                best = (residual, tuple(costs))
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

        None until a finished phase has shown what the link's units cost.
        """
        if not self.finished or self.position < 0:
            return None
        costs = fit_costs([p.units() for p, _ in self.finished],
                          [seconds for _, seconds in self.finished])
        if not any(costs):
            return None

        def predicted(phase: PlannedPhase) -> float:
            return sum(c * u for c, u in zip(costs, phase.units(), strict=True))

        now = self.plan[self.position] if self.position < len(self.plan) else None
        left = sum(predicted(p) for p in self.plan[self.position + 1:])
        if now is not None:
            left += predicted(now) * max(0.0, 1.0 - fraction_done)
        return left
