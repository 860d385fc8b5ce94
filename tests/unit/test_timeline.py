"""kvctl.timeline: a request's steps on one clock from its processes' spans."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from kvctl import timeline
from kvctl.cli import main
from kvctl.timeline import SpanRecord
from kvwired import tracing

T0 = 1_800_000_000.0  # the proxy received the request


def _request(trace: str = "a", transfer: str = "kvw-1") -> list[SpanRecord]:
    """One request's spans as the proxy and two engines record them: two
    pushed heads, one decode rank."""
    ms = 1e-3
    return [
        SpanRecord("kvwire.request", trace, T0, T0 + 90 * ms,
                   [("prefill answered", T0 + 40 * ms), ("decode first chunk", T0 + 70 * ms)],
                   {"kvwire.transfer": transfer}),
        SpanRecord("kvwire.prefill", trace, T0 + 2 * ms, T0 + 38 * ms,
                   [("scheduled", T0 + 3 * ms)]),
        *(SpanRecord("kvwire.push", trace, T0 + (4 + h) * ms, T0 + (50 + h) * ms, [
            ("open sent", T0 + (5 + h) * ms), ("lease granted", T0 + (7 + 3 * h) * ms),
            ("first layer staged", T0 + (10 + h) * ms),
            ("last layer staged", T0 + (30 + 2 * h) * ms),
            ("delivered", T0 + (49 + h) * ms)]) for h in (0, 1)),
        SpanRecord("kvwire.load", trace, T0 + 1 * ms, T0 + 55 * ms, [
            ("push opened", T0 + 8 * ms), ("push opened", T0 + 11 * ms),
            ("first layer landed", T0 + 12 * ms), ("first layer landed", T0 + 13 * ms),
            ("last layer landed", T0 + 44 * ms), ("last layer landed", T0 + 46 * ms),
            ("delivered", T0 + 47 * ms), ("delivered", T0 + 48 * ms)]),
    ]


def test_each_step_is_its_first_or_its_slowest_occurrence_since_the_proxy_took_it() -> None:
    [line] = timeline.timelines(_request()).values()
    got = {label: round(at * 1e3, 3) for label, at in line.steps.items()}
    assert got == {
        "proxy received it": 0.0, "prefill engine took it": 2.0,
        "decode engine waits for it": 1.0, "prefill scheduled": 3.0,
        "prompt's last step began": 4.0,
        "open sent": 5.0, "lease granted": 10.0,  # the slower head's
        "push opened at decode": 11.0,
        "first layer staged": 10.0, "first layer landed": 12.0,
        "last layer staged": 32.0, "prefill engine answered": 38.0,
        "proxy has prefill's answer": 40.0, "last layer landed": 46.0,
        "delivered (decode heard)": 48.0, "delivered (prefill heard)": 50.0,
        "vLLM told the load ended": 55.0, "first token at the proxy": 70.0,
        "proxy answered": 90.0}
    assert line.transfer == "kvw-1" and line.failures == []


def test_traces_the_proxy_did_not_start_or_end_are_left_out_and_failures_shown() -> None:
    spans = _request("a", "kvw-1") + _request("b", "kvw-2")[1:]  # b: no proxy span
    spans[4].failed = "deadline: 20 s passed"  # a's load
    found = timeline.timelines(spans)
    assert list(found) == ["kvw-1"]
    assert found["kvw-1"].failures == ["kvwire.load: deadline: 20 s passed"]
    assert "1 span(s) failed, e.g. kvwire.load: deadline" in timeline.render(
        {"256 tokens": list(found.values())})


def test_the_breakdown_is_a_median_per_step_and_each_step_since_the_one_above() -> None:
    fast = timeline.timelines(_request("a", "kvw-1"))["kvw-1"]
    slow = timeline.Timeline("kvw-2", {k: v * 3 for k, v in fast.steps.items()}, [])
    only_proxy = timeline.Timeline("kvw-3", {"proxy received it": 0.0,
                                             "first token at the proxy": 0.2,
                                             "proxy answered": 0.25}, [])
    rows = {row[0]: row[1:] for row in timeline.breakdown(
        {"short": [fast, slow, fast], "peer": [only_proxy]})}
    assert rows["lease granted"] == ["10.0 (-1.0)", "-"]  # after the push opened at 11
    assert rows["first token at the proxy"] == ["70.0 (+30.0)", "200.0 (+200.0)"]
    assert rows["proxy received it"] == ["0.0", "0.0"]
    summary = timeline.summary([fast, slow, fast])
    assert summary["last layer landed"] == {"p50": 46.0, "min": 46.0, "max": 138.0,
                                            "requests": 3}


def test_collect_waits_for_the_proxy_span_written_after_the_answer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tracing, "_tracer", None)
    tracing.configure("test", str(tmp_path))
    root = tracing.start("kvwire.request", None, {"kvwire.transfer": "kvw-late"})
    child = tracing.start("kvwire.load", tracing.traceparent(root))
    child.add_event("last layer landed")
    child.end()
    ending = threading.Timer(0.3, root.end)
    ending.start()
    try:
        found = timeline.collect(tmp_path, ["kvw-late"], timeout=30)
    finally:
        ending.join()
        monkeypatch.setattr(tracing, "_tracer", None)
    assert set(found["kvw-late"].steps) >= {"proxy received it", "last layer landed",
                                            "vLLM told the load ended", "proxy answered"}
    assert timeline.collect(tmp_path, ["kvw-never"], timeout=0.1) == {}


def _traced_requests(folder: Path, monkeypatch: pytest.MonkeyPatch,
                     transfers: list[str]) -> None:
    """Requests as the proxy and a decode engine trace them, into ``folder``."""
    monkeypatch.setattr(tracing, "_tracer", None)
    tracing.configure("test", str(folder))
    for transfer in transfers:
        root = tracing.start("kvwire.request", None, {"kvwire.transfer": transfer})
        load = tracing.start("kvwire.load", tracing.traceparent(root))
        load.add_event("last layer landed")
        load.end()
        root.add_event("decode first chunk")
        root.end()
    monkeypatch.setattr(tracing, "_tracer", None)


def test_kvctl_timeline_prints_the_folders_requests_and_says_what_is_missing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    _traced_requests(tmp_path, monkeypatch, ["kvw-1", "kvw-2"])
    assert main(["timeline", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "2 requests" in printed and "last layer landed" in printed
    assert main(["timeline", str(tmp_path), "--transfer", "kvw-2", "--json"]) == 0
    steps = json.loads(capsys.readouterr().out)["kvw-2"]
    assert steps["proxy received it"] == 0.0
    assert 0 <= steps["last layer landed"] <= steps["first token at the proxy"]

    assert main(["timeline", str(tmp_path), "--transfer", "kvw-9"]) == 2
    assert "no finished trace of kvw-9" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["timeline", str(empty)]) == 2
    assert "KVWIRE_TRACES=" in capsys.readouterr().err
    assert main(["timeline", str(tmp_path / "missing")]) == 2
    assert "no such folder" in capsys.readouterr().err
