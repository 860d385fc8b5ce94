"""The fault campaign's results: a table, faults.json, faults.csv and a plot."""

from __future__ import annotations

import csv
import datetime
import json
import subprocess
from pathlib import Path
from typing import Any

from .. import table
from .campaign import ScenarioResult

HEADERS = ["scenario", "transport", "attempted", "byte-exact", "failed (typed, by class)",
           "error p50 s", "error p99 s", "recovery p99 s", "corrupt B", "leaked B", "hangs",
           "untyped", "split", "decode not told", "restarts", "took s"]
# Every error must surface within this (the campaign's bar for a fault).
ERROR_BAR_SECONDS = 10.0


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def rows(results: list[ScenarioResult]) -> list[list[Any]]:
    out = []
    for result in results:
        d = result.to_dict()
        if result.not_run:
            out.append([d["name"], d["transport"], "not run"] + ["-"] * (len(HEADERS) - 3))
            continue
        classes = ", ".join(f"{name} {count}" for name, count in d["failed_by_class"].items())
        out.append([d["name"], d["transport"], d["attempted"], d["delivered_verified"],
                    classes or "-", _seconds(d["error_seconds_p50"]),
                    _seconds(d["error_seconds_p99"]), _seconds(d["recovery_seconds_p99"]),
                    d["corrupt_bytes"], d["leaked_bytes"], d["hangs"], d["untyped_errors"],
                    d["split_outcomes"], d["decode_not_told"], d["restarts"],
                    f"{d['seconds']:.0f}"])
    return out


def render(results: list[ScenarioResult]) -> str:
    lines = [table.render(HEADERS, rows(results))]
    lines += [f"{r.name}: not run: {r.not_run}" for r in results if r.not_run]
    lines += [_against_the_wire(r) for r in results if r.reference is not None]
    slow = [f"{r.name} ({max(r.error_seconds):.1f} s)" for r in results
            if r.error_seconds and max(r.error_seconds) >= ERROR_BAR_SECONDS]
    if slow:
        lines.append(f"errors slower than {ERROR_BAR_SECONDS:g} s: {', '.join(slow)}")
    bad = [r.name for r in results if not r.clean]
    lines.append("every scenario clean: 0 corrupt bytes, 0 leaks, 0 hangs, 0 untyped errors, "
                 "0 split outcomes, 0 decode engines left untold" if not bad else
                 f"NOT CLEAN: {', '.join(bad)} (see the notes in faults.json)")
    return "\n".join(lines)


def _against_the_wire(result: ScenarioResult) -> str:
    """A wire scenario's pushes beside the plain tool on the same wire: the
    deadline they had, and how those that were not delivered ended."""
    assert result.reference is not None
    line = (f"{result.name}: {result.reference.describe()}; "
            f"{result.delivered_verified}/{result.attempted} delivered byte-exact")
    failed = result.attempted - result.delivered_verified
    if failed and result.failed_by_class:
        classes = ", ".join(f"{name} {n}" for name, n in sorted(result.failed_by_class.items()))
        line += (f"; the rest ended {classes}, "
                 f"{min(result.error_seconds, default=0):.1f}-"
                 f"{max(result.error_seconds, default=0):.1f} s after the push began")
    return line


def document(results: list[ScenarioResult], setup: dict[str, Any] | None = None
             ) -> dict[str, Any]:
    """The whole campaign; ``setup`` says where it ran and what it pushed."""
    return {"scenarios": [r.to_dict() for r in results], "commit": _commit(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            **(setup or {})}


def _commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=Path(__file__).resolve().parent)
    return done.stdout.strip() or "unknown"


def write(results: list[ScenarioResult], out_dir: Path,
          setup: dict[str, Any] | None = None) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = document(results, setup)
    json_path = out_dir / "faults.json"
    json_path.write_text(json.dumps(doc, indent=2) + "\n")
    csv_path = out_dir / "faults.csv"
    with csv_path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(HEADERS)
        writer.writerows(rows(results))
    return [json_path, csv_path, _plot(results, out_dir / "faults.png")]


def _plot(results: list[ScenarioResult], path: Path) -> Path:
    from ..plots import figure, save

    fig, ax = figure(10, 5)
    names = [r.name for r in results]
    for offset, key, label, style in ((-0.15, "error_seconds", "time to the error", "C0o"),
                                      (0.15, "recovery_seconds", "time to recovery", "C1s")):
        xs = [x + offset for x, r in enumerate(results) for _ in getattr(r, key)]
        ys = [value for r in results for value in getattr(r, key)]
        ax.plot(xs, ys, style, alpha=0.6, label=label)
    ax.set_xticks(range(len(names)), names, rotation=40, ha="right")
    ax.set_ylabel("seconds (each iteration)")
    ax.set_yscale("symlog", linthresh=0.1)
    ax.set_ylim(bottom=0)
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_title("Faults: time to the typed error, time until pushes succeed again")
    ax.legend()
    return save(fig, path)
