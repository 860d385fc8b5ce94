"""What the data path costs the CPU: user and system seconds per write and per GiB.

A real NIC moves bytes without the host's CPU; what is left to the host is
posting the writes and reaping their completions, in user space. So over
verbs the figure that says whether one core can keep a NIC busy is the user
time a write costs: at ``u`` seconds a write of ``size`` bytes, one core can
post ``size / u`` bytes a second, whatever the wire could take. Emulated
RDMA (rdma_rxe) moves the bytes in the kernel, in system time a real NIC
would not spend: reported beside, never counted. Over TCP the kernel's time
is the transport's own work, which a real NIC leaves to the host as well,
so there both are counted (``counts_kernel``).

The daemon's own time is ``getrusage(RUSAGE_SELF)``, all its threads (the
experiment runs alone in it). Its sum, user and system, is exact; the kernel
splits it between the two by sampling at each timer tick (4 ms at 250 Hz),
so a stretch of a few ticks is split roughly, and the rounds of a sweep are
long enough for their median to settle.

perftest busy-polls its completions, so while it measures, its CPU is its
wall time: a write costs it one core for ``1 / rate`` (``busy_polled``).
Its whole run's ``getrusage`` would say more and mean less: on the emulated
nodes its start-up (devices, queue pairs, the TCP exchange) took more CPU
than a short run's writes.
"""

from __future__ import annotations

import resource
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

GIB = 1 << 30


@dataclass(frozen=True)
class CpuTimes:
    """CPU seconds, user and system."""

    user: float
    system: float

    def __sub__(self, other: CpuTimes) -> CpuTimes:
        return CpuTimes(self.user - other.user, self.system - other.system)


def own() -> CpuTimes:
    """This process's CPU time so far, all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return CpuTimes(usage.ru_utime, usage.ru_stime)


@dataclass(frozen=True)
class WriteCost:
    """One measured stretch of ``writes`` writes of ``size`` bytes."""

    size: int
    writes: int
    cpu: CpuTimes
    counts_kernel: bool = False  # the kernel's time is the transport's (TCP)

    @property
    def user_us_per_write(self) -> float:
        return self.cpu.user / self.writes * 1e6

    @property
    def system_us_per_write(self) -> float:
        return self.cpu.system / self.writes * 1e6

    @property
    def user_s_per_gib(self) -> float:
        return self.cpu.user / (self.writes * self.size) * GIB

    @property
    def counted(self) -> float:
        """The seconds one core would spend on these writes with a real NIC."""
        return self.cpu.user + (self.cpu.system if self.counts_kernel else 0.0)

    @property
    def one_core_gbps(self) -> float | None:
        """The rate, 1e9 bit/s, at which one core could post these writes; None
        when no tick fell in the counted time."""
        if self.counted <= 0:
            return None
        return self.writes * self.size * 8 / self.counted / 1e9


def busy_polled(size: int, writes_per_s: float) -> WriteCost | None:
    """The cost of a write to a tool that spins a core on its completions, at
    the rate it reported; None if it reported none."""
    if writes_per_s <= 0:
        return None
    return WriteCost(size, 1, CpuTimes(1 / writes_per_s, 0.0))


def figures(prefix: str, costs: Sequence[WriteCost]) -> dict[str, Any]:
    """The median over rounds of each figure, named ``<prefix>_...``, and the
    rounds' user time per GiB (for ratios made round by round)."""
    one_core = [c.one_core_gbps for c in costs if c.one_core_gbps is not None]
    return {
        f"{prefix}_user_us_per_write": statistics.median(c.user_us_per_write for c in costs),
        f"{prefix}_system_us_per_write": statistics.median(
            c.system_us_per_write for c in costs),
        f"{prefix}_user_s_per_gib": statistics.median(c.user_s_per_gib for c in costs),
        f"{prefix}_rounds_user_s_per_gib": [c.user_s_per_gib for c in costs],
        f"{prefix}_counts_kernel": any(c.counts_kernel for c in costs),
        f"{prefix}_one_core_gbps": statistics.median(one_core) if one_core else None,
    }
