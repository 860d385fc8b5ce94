"""Figures in words: a ratio with its spread, and what the spread means."""

from __future__ import annotations

from typing import Any

from kvwired.analysis import Spread, spread
from kvwired.units import format_size

# Said once under a summary that marked a figure "within the spread".
NOISE_NOTE = ("within the spread: the rounds disagree by more than the figure differs "
              "from 1 (or fall on both sides of it); the emulated link drifted more "
              "between rounds than the two sides differ, so read it as a tendency")


def times(figure: Spread | None) -> str:
    """``x1.26 (0.90 to 1.40)`` with an en dash; ``x1.26`` with one round; ``-`` with none."""
    if figure is None:
        return "-"
    text = f"x{figure.median:.2f}"
    if figure.low is not None and figure.high is not None:
        text += f" ({figure.low:.2f}\N{EN DASH}{figure.high:.2f})"
    if figure.wider_than_effect():
        text += " within the spread"
    return text


def ratio_spread(entry: dict[str, Any], key: str) -> Spread | None:
    """A ratio of the JSON (``key``) with its spread (``key``_spread), as measured."""
    median = entry.get(key)
    if median is None:
        return None
    bounds = entry.get(f"{key}_spread")
    if not bounds:
        return Spread(float(median))
    return Spread(float(median), float(bounds[0]), float(bounds[1]))


def with_spread(entry: dict[str, Any], key: str, rounds: list[float]) -> None:
    """Put ``key`` (the median of ``rounds``) and ``key``_spread into ``entry``."""
    figure = spread(rounds)
    entry[key] = None if figure is None else figure.median
    entry[f"{key}_spread"] = None if figure is None else figure.to_wire()


def knee_certainty(summary: dict[str, Any]) -> str:
    """How sure the knee is: the sizes it could be, given each size's rounds."""
    bounds = summary.get("knee_range_bytes")
    if not bounds:
        return "one round: no spread"
    earliest, latest = bounds
    if earliest == latest == summary["knee_bytes"]:
        return "every round agrees"
    return (f"within the rounds' spread it could be {format_size(earliest)} to "
            f"{format_size(latest)}")


def speedup_text(summary: dict[str, Any]) -> str:
    """The peak speedup with its pairs' spread, and words if the spread
    reaches below 1 (no speedup) or is wider than the gain."""
    peak = ratio_spread({"speedup": summary["peak_speedup"],
                         "speedup_spread": summary.get("peak_speedup_spread")}, "speedup")
    return times(peak).removeprefix("x")


# The sizes the sender's CPU per write is quoted at: a token of a layer, a
# token, a block of a few hundred tokens, a layer.
CPU_SIZES = (512, 12 << 10, 512 << 10, 2 << 20)


def cpu_lines(rows: list[dict[str, Any]], slowdown: float | None = None) -> list[str]:
    """The sender's CPU per write at the quoted sizes, against ib_write_bw's where
    it ran, and what one core could drive: the lines ``make demo`` ends with.
    ``slowdown``: how many times slower the sender's core ran Python than this
    host's (the lab's emulated nodes), to read user time as one of these cores."""
    quoted = [r for r in rows if r["size"] in CPU_SIZES and "stream_cpu_user_us_per_write" in r]
    if not quoted:
        return []
    lines = []
    if any("perftest_cpu_user_us_per_write" in r for r in quoted):
        said = [f"{format_size(r['size'])} {r['stream_cpu_user_us_per_write']:.2f} vs "
                f"{number(r.get('perftest_cpu_user_us_per_write'), '.2f')} µs, "
                f"x{number(r.get('cpu_ratio'), '.2f')}" for r in quoted]
        lines.append("sender CPU per write, kvwire vs ib_write_bw (which spins a core): "
                     + "; ".join(said))
    counted = ("user and system time" if any(r.get("stream_cpu_counts_kernel") for r in quoted)
               else "user time")
    lines.append(f"one core's {counted} could post: " + ", ".join(
        f"{format_size(r['size'])} {number(r['stream_cpu_one_core_gbps'], '.1f')} Gb/s"
        for r in quoted))
    if slowdown is not None and counted == "user time":
        lines.append(f"... on one of this host's cores (the node's emulated core ran the same "
                     f"Python {slowdown:.1f}x slower): " + ", ".join(
                         f"{format_size(r['size'])} "
                         f"{number(_scaled(r['stream_cpu_one_core_gbps'], slowdown), '.1f')} Gb/s"
                         for r in quoted))
    return lines


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def number(value: float | None, spec: str) -> str:
    """A figure formatted, or "-" where there is none."""
    return "-" if value is None else format(value, spec)
