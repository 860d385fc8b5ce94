"""Where a disaggregated request's time went, from the spans its processes wrote.

The proxy, the prefill engine and the decode engine each record their part
of a request as OpenTelemetry spans of one trace (kvwired.tracing, with
``KVWIRE_TRACES`` naming a folder). This reads those folders back and puts
each request's steps on one clock, from the moment the proxy took it:

    proxy: kvwire.request        received .. answered; "prefill answered",
                                 "decode first chunk" (the first token)
    prefill: kvwire.prefill      the engine took it; "scheduled"; answered
    prefill: kvwire.push         the step that computes the prompt's last
                                 chunk began; "open sent", "lease granted",
                                 "first layer staged", "last layer staged",
                                 "delivered" (one span per pushed head)
    decode: kvwire.load          it waits for the push; "push opened",
                                 "first layer landed", "last layer landed",
                                 "delivered"; vLLM told it ended

A step several spans record (a push per head, a load per rank) is taken at
its first occurrence for "first ..." steps and "open sent", else at its last:
a request waits for the slowest of its pushes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvwired.analysis import percentile
from kvwired.errors import UsageError
from kvwired.tracing import ENV

from . import table
from .figures import number


@dataclass(frozen=True)
class Step:
    """One step of the timeline: where it is read from and which occurrence counts."""

    label: str
    span: str
    event: str | None  # None: the span's start, or its end (``at_end``)
    first: bool = False  # the earliest occurrence (else the latest)
    at_end: bool = False


STEPS: tuple[Step, ...] = (  # in the order they usually come
    Step("prefill engine took it", "kvwire.prefill", None, first=True),
    Step("prefill scheduled", "kvwire.prefill", "scheduled", first=True),
    Step("decode engine waits for it", "kvwire.load", None, first=True),
    Step("prompt's last step began", "kvwire.push", None, first=True),
    Step("open sent", "kvwire.push", "open sent", first=True),
    Step("push opened at decode", "kvwire.load", "push opened"),
    Step("lease granted", "kvwire.push", "lease granted"),
    Step("first layer staged", "kvwire.push", "first layer staged", first=True),
    Step("first layer landed", "kvwire.load", "first layer landed", first=True),
    Step("last layer staged", "kvwire.push", "last layer staged"),
    Step("last layer landed", "kvwire.load", "last layer landed"),
    Step("delivered (decode heard)", "kvwire.load", "delivered"),
    Step("delivered (prefill heard)", "kvwire.push", "delivered"),
    Step("vLLM told the load ended", "kvwire.load", None, at_end=True),
    Step("prefill engine answered", "kvwire.prefill", None, at_end=True),
    Step("proxy has prefill's answer", "kvwire.request", "prefill answered"),
    Step("first token at the proxy", "kvwire.request", "decode first chunk"),
)


@dataclass
class SpanRecord:
    name: str
    trace: str
    start: float  # seconds since the epoch
    end: float
    events: list[tuple[str, float]] = field(default_factory=list)
    attributes: dict[str, Any] = field(default_factory=dict)
    failed: str | None = None  # the status's description, when it failed

    @classmethod
    def from_json(cls, span: dict[str, Any]) -> SpanRecord:
        status = span.get("status") or {}
        return cls(span["name"], span["context"]["trace_id"], _seconds(span["start_time"]),
                   _seconds(span["end_time"]),
                   [(e["name"], _seconds(e["timestamp"])) for e in span.get("events", [])],
                   dict(span.get("attributes") or {}),
                   (status.get("description") or "error")
                   if status.get("status_code") == "ERROR" else None)


def _seconds(iso: str) -> float:
    return datetime.datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def read_spans(folder: Path) -> list[SpanRecord]:
    """Every span the processes tracing into ``folder`` have ended so far."""
    spans = []
    for path in sorted(folder.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                spans.append(SpanRecord.from_json(json.loads(line)))
    return spans


@dataclass
class Timeline:
    """One request: each step's time since the proxy received it (seconds)."""

    transfer: str
    steps: dict[str, float]
    failures: list[str]


def timelines(spans: Iterable[SpanRecord]) -> dict[str, Timeline]:
    """Per transfer id, the timeline of each request the proxy traced."""
    by_trace: dict[str, list[SpanRecord]] = defaultdict(list)
    for span in spans:
        by_trace[span.trace].append(span)
    found: dict[str, Timeline] = {}
    for trace in by_trace.values():
        roots = [s for s in trace if s.name == "kvwire.request"]
        if len(roots) != 1:
            continue  # a trace the proxy did not start (or has not ended yet)
        root = roots[0]
        steps = {"proxy received it": 0.0}
        for step in STEPS:
            at = _occurrence(trace, step)
            if at is not None:
                steps[step.label] = at - root.start
        steps["proxy answered"] = root.end - root.start
        transfer = str(root.attributes.get("kvwire.transfer", trace[0].trace))
        found[transfer] = Timeline(transfer, steps,
                                   [f"{s.name}: {s.failed}" for s in trace if s.failed])
    return found


def _occurrence(trace: Sequence[SpanRecord], step: Step) -> float | None:
    times = []
    for span in trace:
        if span.name != step.span:
            continue
        if step.event is None:
            times.append(span.end if step.at_end else span.start)
        else:
            times += [t for name, t in span.events if name == step.event]
    if not times:
        return None
    return min(times) if step.first else max(times)


LABELS = ("proxy received it", *(s.label for s in STEPS), "proxy answered")


def breakdown(groups: Mapping[str, Sequence[Timeline]]) -> list[list[object]]:
    """Rows of the median timeline of each group of requests (a column
    each): a step's time since the proxy received the request, and in
    brackets since the step above it (the median of each request's own
    difference, so a step that varies does not blur the next one)."""
    rows: list[list[object]] = []
    for n, label in enumerate(LABELS):
        cells: list[object] = [label]
        for requests in groups.values():
            ats = [r.steps[label] for r in requests if label in r.steps]
            if not ats:
                cells.append("-")
                continue
            above = next((earlier for earlier in reversed(LABELS[:n])
                          if any(earlier in r.steps for r in requests)), None)
            since = [r.steps[label] - r.steps[above] for r in requests
                     if above is not None and label in r.steps and above in r.steps]
            cells.append(number(percentile(ats, 50) * 1e3, ".1f")
                         + (f" ({percentile(since, 50) * 1e3:+.1f})" if since else ""))
        if any(cell != "-" for cell in cells[1:]):
            rows.append(cells)
    return rows


def render(groups: Mapping[str, Sequence[Timeline]]) -> str:
    """The breakdown as a table, a column per group, and any failed spans."""
    text = table.render(["step: ms since the proxy received it, p50 (since the step above)",
                         *groups], breakdown(groups))
    failures = [f for requests in groups.values() for r in requests for f in r.failures]
    if failures:
        text += f"\n{len(failures)} span(s) failed, e.g. {failures[0]}"
    return text


def summary(requests: Sequence[Timeline]) -> dict[str, dict[str, float]]:
    """Per step: its median, least and most time since received (ms), for results files."""
    out: dict[str, dict[str, float]] = {}
    for label in LABELS:
        ats = sorted(r.steps[label] * 1e3 for r in requests if label in r.steps)
        if ats:
            out[label] = {"p50": round(percentile(ats, 50), 2), "min": round(ats[0], 2),
                          "max": round(ats[-1], 2), "requests": len(ats)}
    return out


def collect(folder: Path, transfers: Iterable[str], timeout: float = 10.0
            ) -> dict[str, Timeline]:
    """The timelines of ``transfers`` from ``folder``, once each one's proxy span
    is written (the proxy ends it just after the answer's last byte)."""
    wanted = set(transfers)
    ends = time.monotonic() + timeout
    while True:
        found = {t: line for t, line in timelines(read_spans(folder)).items() if t in wanted}
        if len(found) == len(wanted) or time.monotonic() > ends:
            return found
        time.sleep(0.05)


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "timeline", help="where traced vLLM requests' time went (spans from KVWIRE_TRACES)")
    parser.set_defaults(handler=main)
    parser.add_argument("folder", type=Path,
                        help="the folder that the proxy's and engines' KVWIRE_TRACES named")
    parser.add_argument("--transfer", action="append", default=[], metavar="ID",
                        help="only this request (its x-kvwire-transfer); repeat for more: "
                        "a column each (default: every finished request, in one column)")
    parser.add_argument("--json", action="store_true",
                        help="each request's steps, in ms since the proxy received it")


def main(args: argparse.Namespace) -> int:
    if not args.folder.is_dir():
        raise UsageError(f"{args.folder}: no such folder",
                         hint="name the folder KVWIRE_TRACES named for the proxy and engines")
    found = timelines(read_spans(args.folder))
    if args.transfer:
        missing = [t for t in args.transfer if t not in found]
        if missing:
            raise UsageError(f"no finished trace of {', '.join(missing)} in {args.folder}",
                             hint="a request is there once the proxy has answered it, and "
                             "only if the proxy and both engines ran with KVWIRE_TRACES set")
        found = {t: found[t] for t in args.transfer}
    if not found:
        raise UsageError(f"no finished request traced in {args.folder}",
                         hint=f"run kvctl proxy and both vllm serve with {ENV}={args.folder} "
                         "(and kvwire[trace] installed), then send a request through the proxy")
    if args.json:
        print(json.dumps({t: {label: round(at * 1e3, 3) for label, at in line.steps.items()}
                          for t, line in found.items()}, indent=2))
        return 0
    groups = ({t: [line] for t, line in found.items()} if args.transfer
              else {f"{len(found)} requests": list(found.values())})
    print(render(groups))
    return 0
