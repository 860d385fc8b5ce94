"""PNG plots of the experiments (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot: render to files, never to a screen

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.ticker import FuncFormatter

from kvwired.layout import KVLayout
from kvwired.units import format_size

GRANULARITY_MARKS = {
    "token x layer": KVLayout().token_layer_bytes,
    "token": KVLayout().token_bytes,
    "layer": KVLayout().layer_bytes,
    "whole cache": KVLayout().total_bytes,
}


def _size_axis(ax: Axes) -> None:
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: format_size(int(x))))
    ax.set_xlabel("write size")
    ax.grid(True, which="both", alpha=0.3)


def figure(width: float = 8, height: float = 5) -> tuple[Any, Axes]:
    """A new figure with one plot, rendered to files only."""
    return plt.subplots(figsize=(width, height))


def save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _with_spread(ax: Axes, xs: list[float], medians: list[float],
                 bounds: list[list[float] | None], style: str, label: str) -> None:
    """A line of medians; where a point was measured in rounds, a bar from
    its lowest to its highest round (the spread the summary quotes)."""
    below = [m - b[0] if b else 0.0 for m, b in zip(medians, bounds, strict=True)]
    above = [b[1] - m if b else 0.0 for m, b in zip(medians, bounds, strict=True)]
    if any(below) or any(above):
        ax.errorbar(xs, medians, yerr=[below, above], fmt=style, capsize=3, label=label)
    else:
        ax.plot(xs, medians, style, label=label)


def _range(rounds: list[float] | None) -> list[float] | None:
    return [min(rounds), max(rounds)] if rounds and len(rounds) > 1 else None


def sweep_latency(rows: list[dict[str, Any]], path: Path, title: str) -> Path:
    fig, ax = plt.subplots(figsize=(8, 5))
    rows = [r for r in rows if "lat_p50_us" in r]  # sizes with a ping-pong
    sizes = [r["size"] for r in rows]
    _with_spread(ax, sizes, [r["lat_p50_us"] for r in rows],
                 [_range(r.get("lat_rounds_p50_us")) for r in rows], "o-",
                 "kvwire p50 (bars: lowest to highest round's p50)")
    for key, label, style in (("lat_p99_us", "kvwire p99", "s--"),
                              ("lat_p999_us", "kvwire p99.9", "^:")):
        ax.plot(sizes, [r[key] for r in rows], style, label=label)
    with_perftest = [r for r in rows if "perftest_lat_typical_us" in r]
    if with_perftest:
        _with_spread(ax, [r["size"] for r in with_perftest],
                     [r["perftest_lat_typical_us"] for r in with_perftest],
                     [_range(r.get("perftest_lat_rounds_us")) for r in with_perftest], "kx-",
                     "ib_write_lat typical")
        ax.plot([r["size"] for r in with_perftest],
                [r["perftest_lat_p99_us"] for r in with_perftest], "k+:",
                label="ib_write_lat p99")
    _size_axis(ax)
    ax.set_yscale("log")
    ax.set_ylabel("half round trip (µs)")
    ax.set_title(title)
    ax.legend()
    return save(fig, path)


def sweep_bandwidth(rows: list[dict[str, Any]], path: Path, title: str,
                    knee: int | None, recommended: int | None,
                    knee_range: list[int] | None = None) -> Path:
    fig, ax = plt.subplots(figsize=(8, 5))
    sizes = [r["size"] for r in rows]
    _with_spread(ax, sizes, [r["stream_gbps"] for r in rows],
                 [_range(r.get("stream_rounds_gbps")) for r in rows], "o-",
                 "kvwire streaming (bars: lowest to highest round)")
    delivered = [r for r in rows if "deliver_gbps" in r]
    if delivered:
        ax.plot([r["size"] for r in delivered], [r["deliver_gbps"] for r in delivered], "s--",
                label="48 MiB cache delivered (request path)")
    with_perftest = [r for r in rows if "perftest_gbps" in r]
    if with_perftest:
        _with_spread(ax, [r["size"] for r in with_perftest],
                     [r["perftest_gbps"] for r in with_perftest],
                     [_range(r.get("perftest_rounds_gbps")) for r in with_perftest], "kx-",
                     "ib_write_bw")
    _size_axis(ax)
    top = max([max([r["stream_gbps"], *r.get("stream_rounds_gbps", [])]) for r in rows]
              + [max([r.get("perftest_gbps", 0), *r.get("perftest_rounds_gbps", [])])
                 for r in rows])
    for name, size in GRANULARITY_MARKS.items():
        ax.axvline(size, color="grey", alpha=0.4, linewidth=1)
        ax.text(size, top * 1.02, f" per {name}", rotation=90, va="bottom", ha="center",
                fontsize=8, color="grey")
    if knee is not None:
        ax.axvline(knee, color="tab:red", linestyle="--", label=f"knee {format_size(knee)}")
    if knee_range and knee_range[0] != knee_range[1]:
        ax.axvspan(knee_range[0], knee_range[1], color="tab:red", alpha=0.08,
                   label=f"knee within the rounds' spread: {format_size(knee_range[0])} to "
                         f"{format_size(knee_range[1])}")
    if recommended is not None and recommended != knee:
        ax.axvline(recommended, color="tab:green", linestyle=":",
                   label=f"recommended {format_size(recommended)}")
    ax.set_ylim(0, top * 1.35 if top > 0 else 1)
    ax.set_ylabel("Gb/s")
    ax.set_title(title)
    ax.legend(loc="lower right")
    return save(fig, path)


def overlap_speedup(rows: list[dict[str, Any]], path: Path, title: str,
                    deployment_ratio: float | None) -> Path:
    fig, ax = plt.subplots(figsize=(8, 5))
    ratios = [r["ratio"] for r in rows]
    _with_spread(ax, ratios, [r["speedup"] for r in rows],
                 [r.get("speedup_spread") for r in rows], "o-",
                 "measured speedup (bars: lowest to highest pair)")
    ax.plot(ratios, [r["ideal_speedup"] for r in rows], "k--", label="ideal N(Tc+Tx)/(N max + min)")
    ax.plot(ratios, [r["ceiling_speedup"] for r in rows], "k:",
            label="ceiling on this link's T_x spread")
    ax.axvline(1.0, color="tab:red", alpha=0.6, label="ridge Tc = Tx")
    if deployment_ratio is not None:
        ax.axvline(deployment_ratio, color="tab:green", linestyle=":",
                   label=f"this deployment (Tc/Tx = {deployment_ratio:.2g})")
    ax.set_xlabel("compute / transfer per layer (Tc/Tx)")
    ax.set_ylabel("speedup of overlapped over sequential")
    ax.set_ylim(0.8, 2.2)
    ax.grid(True, alpha=0.3)
    ax.set_title(title)
    ax.legend()
    return save(fig, path)


def overlap_bandwidth(rows: list[dict[str, Any]], path: Path, title: str) -> Path:
    fig, ax = plt.subplots(figsize=(8, 5))
    ratios = [r["ratio"] for r in rows]
    ax.plot(ratios, [r["sequential_gbps"] for r in rows], "s--", label="sequential")
    ax.plot(ratios, [r["overlapped_gbps"] for r in rows], "o-", label="overlapped")
    ax.set_xlabel("compute / transfer per layer (Tc/Tx)")
    ax.set_ylabel("effective Gb/s (bytes / (compute + transfer))")
    ax.grid(True, alpha=0.3)
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.legend()
    return save(fig, path)
