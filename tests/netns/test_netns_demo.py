"""``kvctl demo netns`` (``make demo-netns``): every granularity delivered and
verified, each beside the plain socket loop on the same link, ratios in its JSON."""

from __future__ import annotations

import io
import json
import statistics
from pathlib import Path

import pytest

from kvctl.netns import check_can_run
from kvctl.netns_demo import netns_demo
from kvwired.layout import GRANULARITIES, KVLayout

_why_not = check_can_run()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(_why_not is not None, reason=_why_not or "")]


async def test_the_demo_puts_each_granularity_beside_the_plain_loop(tmp_path: Path) -> None:
    out = io.StringIO()
    records = await netns_demo(repeat=1, out=out, results=tmp_path, pairs=2)
    assert [r.req for r in records] == list(GRANULARITIES)
    assert all(r.verified for r in records)
    document = json.loads((tmp_path / "demo-netns.json").read_text())
    rows = document["against_socket_loop"]
    assert [row["request"] for row in rows] == list(GRANULARITIES)
    for row in rows:
        # kvwire's time alone: the engine's copies into staging taken out.
        staged = row["staged_pushes"]
        assert len(staged) == 2 and all(p["staged"] and p["verified"] for p in staged)
        moved = [p["seconds"] - p["write_seconds"] for p in staged]
        assert row["kvwire_seconds"] == pytest.approx(statistics.median(moved))
        assert all(0 < m < p["seconds"] for m, p in zip(moved, staged, strict=True))
        # Each push beside the warm loop round run right after it.
        assert len(row["loop_rounds"]) == 2 and all(s > 0 for s in row["loop_rounds"])
        assert row["pair_ratios"] == pytest.approx(
            [m / s for m, s in zip(moved, row["loop_rounds"], strict=True)])
        assert row["time_ratio"] == pytest.approx(statistics.median(row["pair_ratios"]))
        assert row["engine_time_ratio"] == pytest.approx(
            row["engine_seconds"] / row["loop_seconds"])
    assert document["bytes"] == KVLayout().total_bytes
    text = out.getvalue()
    assert "plain loop ms" in text and "x loop" in text
