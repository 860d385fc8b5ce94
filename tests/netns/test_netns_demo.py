"""``kvctl demo netns`` (``make demo-netns``): every granularity delivered and
verified, each beside the plain socket loop on the same link, ratios in its JSON."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from kvctl.netns import check_can_run
from kvctl.netns_demo import netns_demo
from kvwired.layout import GRANULARITIES, KVLayout

_why_not = check_can_run()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(_why_not is not None, reason=_why_not or "")]


async def test_the_demo_puts_each_granularity_beside_the_plain_loop(tmp_path: Path) -> None:
    out = io.StringIO()
    records = await netns_demo(repeat=1, out=out, results=tmp_path)
    assert [r.req for r in records] == list(GRANULARITIES)
    assert all(r.verified for r in records)
    document = json.loads((tmp_path / "demo-netns.json").read_text())
    rows = document["against_socket_loop"]
    assert [row["request"] for row in rows] == list(GRANULARITIES)
    for row in rows:
        # kvwire's time alone: the engine's copies into staging taken out.
        (staged,) = row["staged_pushes"]
        assert staged["staged"] and staged["verified"]
        assert row["kvwire_seconds"] == pytest.approx(
            staged["seconds"] - staged["write_seconds"])
        assert 0 < row["kvwire_seconds"] < staged["seconds"]
        assert row["loop_seconds"] > 0 and len(row["loop_rounds"]) == 1
        assert row["time_ratio"] == pytest.approx(row["kvwire_seconds"] / row["loop_seconds"])
        assert row["engine_time_ratio"] == pytest.approx(
            row["engine_seconds"] / row["loop_seconds"])
    assert document["bytes"] == KVLayout().total_bytes
    text = out.getvalue()
    assert "plain loop ms" in text and "x loop" in text
