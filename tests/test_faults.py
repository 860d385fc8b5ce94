"""The fault campaign: its accounting, its report, and a short campaign between
two namespaces (the full one: ``kvctl run faults``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvctl.faults import report
from kvctl.faults.campaign import Campaign, ScenarioResult, _quantile
from kvctl.faults.engine import corrupt_bytes, failure
from kvctl.faults.scenarios import SCENARIOS, SHORT, select
from kvctl.faults.wire import WireFaults
from kvctl.netns import check_can_run
from kvwired.errors import KvwireError, PeerLost, UsageError

REQUIRED = {"name", "transport", "iterations", "attempted", "delivered_verified",
            "failed_by_class", "error_seconds_p50", "error_seconds_p99",
            "recovery_seconds_p99", "corrupt_bytes", "leaked_bytes", "hangs",
            "untyped_errors", "restarts"}


def _account(endings: dict[str, dict[str, Any]], struck: float | None = 0.0,
             hung: bool = False) -> ScenarioResult:
    result = ScenarioResult("s", "process", "tcp")
    Campaign._account(Campaign.__new__(Campaign), SCENARIOS[0], result, endings, struck, hung,
                      "req")
    return result


def test_a_push_delivered_byte_exact_at_both_ends_counts_as_such() -> None:
    result = _account({"prefill": {"e": "finished", "at": 1.0},
                       "decode": {"e": "released", "at": 1.1, "corrupt": 0}})
    assert result.delivered_verified == 1 and result.clean


def test_corrupt_bytes_are_counted_and_spoil_the_scenario() -> None:
    result = _account({"prefill": {"e": "finished", "at": 1.0},
                       "decode": {"e": "released", "at": 1.1, "corrupt": 7}})
    assert result.delivered_verified == 0 and result.corrupt_bytes == 7 and not result.clean


def test_a_typed_failure_is_counted_by_class_with_its_time_to_error() -> None:
    typed = {"e": "failed", "class": "PeerLost", "typed": True, "message": "gone"}
    result = _account({"prefill": {**typed, "at": 2.5}, "decode": {**typed, "at": 2.7}},
                      struck=2.0)
    assert result.failed_by_class == {"PeerLost": 1}
    assert result.error_seconds == [0.5] and result.clean


def test_untyped_errors_and_silent_exits_spoil_the_scenario() -> None:
    result = _account({"prefill": {"e": "failed", "class": "ValueError", "typed": False,
                                   "message": "x", "at": 1.0},
                       "decode": {"e": "exit", "at": 1.0}})
    assert result.untyped_errors == 2 and not result.clean


def test_finished_at_one_end_and_not_delivered_at_the_other_is_a_split() -> None:
    result = _account({"prefill": {"e": "finished", "at": 1.0},
                       "decode": {"e": "failed", "class": "PeerLost", "typed": True,
                                  "message": "", "at": 1.0}})
    assert result.split_outcomes == 1 and not result.clean
    # Delivered, then the receiver died before the release: one outcome still.
    result = _account({"prefill": {"e": "finished", "at": 1.0},
                       "decode": {"e": "failed", "class": "DaemonUnavailable", "typed": True,
                                  "message": "", "at": 1.2, "corrupt": 0}})
    assert result.split_outcomes == 0 and result.delivered_verified == 1
    # A killed engine has no outcome to agree with.
    result = _account({"prefill": {"e": "finished", "at": 1.0},
                       "decode": {"e": "killed", "at": 0.5}})
    assert result.split_outcomes == 0 and result.clean


def test_a_hang_spoils_the_scenario() -> None:
    assert not _account({}, hung=True).clean


@given(st.binary(min_size=1, max_size=256), st.data())
def test_corrupt_bytes_counts_exactly_the_bytes_that_differ(sent: bytes,
                                                           data: st.DataObject) -> None:
    flips = data.draw(st.sets(st.integers(0, len(sent) - 1)))
    got = bytearray(sent)
    for i in flips:
        got[i] ^= 0xFF
    assert corrupt_bytes(memoryview(bytes(got)), np.frombuffer(sent, np.uint8)) == len(flips)
    assert corrupt_bytes(memoryview(sent[:-1]), np.frombuffer(sent, np.uint8)) == len(sent)


def test_only_kvwire_subclasses_count_as_typed() -> None:
    assert failure(PeerLost("gone"))["typed"] is True
    assert failure(KvwireError("bare"))["typed"] is False
    assert failure(ValueError("x"))["typed"] is False


@given(st.lists(st.floats(0, 1e4, allow_nan=False), min_size=1, max_size=50))
def test_quantiles_lie_within_the_samples(values: list[float]) -> None:
    for q in (0.5, 0.99):
        value = _quantile(values, q)
        assert value is not None and min(values) <= value <= max(values)
    assert _quantile([], 0.5) is None


def test_scenarios_are_selected_by_name_and_a_wrong_name_says_which_exist() -> None:
    assert [s.name for s in select(list(SHORT), "tcp")] == list(SHORT)
    assert len(select(None, "tcp")) == len(SCENARIOS)
    with pytest.raises(UsageError, match="no fault scenario named nope") as info:
        select(["nope"], "tcp")
    assert "kill-receiver" in (info.value.hint or "")
    assert len({s.name for s in SCENARIOS}) == len(SCENARIOS)
    for scenario in SCENARIOS:
        assert scenario.kind in ("wire", "process", "resource")
        assert bool(scenario.netem or scenario.blackout or scenario.action), scenario


def test_loss_can_always_be_put_on_the_wire() -> None:
    wire = WireFaults()
    assert wire.can_emulate("loss 1%") is None and wire.can_emulate("loss 100%") is None


def test_the_report_holds_every_figure_and_says_what_is_not_clean(tmp_path: Path) -> None:
    clean = ScenarioResult("loss-1%", "wire", "tcp", 3, 3, 3)
    dirty = ScenarioResult("kill-receiver", "process", "tcp", 3, 3, 1, hangs=1,
                           error_seconds=[0.1, 0.2], recovery_seconds=[1.0])
    dirty.failed_by_class["PeerLost"] = 2
    skipped = ScenarioResult("corrupt-0.1%", "wire", "tcp", not_run="no netem here")
    text = report.render([clean, dirty, skipped])
    assert "NOT CLEAN: kill-receiver" in text and "PeerLost 2" in text
    assert "corrupt-0.1%: not run: no netem here" in text
    paths = report.write([clean, dirty, skipped], tmp_path)
    assert sorted(p.name for p in paths) == ["faults.csv", "faults.json", "faults.png"]
    doc = json.loads((tmp_path / "faults.json").read_text())
    assert {"scenarios", "commit", "date"} <= set(doc)
    for scenario in doc["scenarios"]:
        assert set(scenario) >= REQUIRED
    assert doc["scenarios"][1]["error_seconds_p50"] == 0.1


_why_not = check_can_run()


@pytest.mark.netns
@pytest.mark.skipif(_why_not is not None, reason=_why_not or "")
def test_a_short_campaign_between_two_namespaces_is_clean(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "kvctl", "run", "faults", "--short",
                           "--out", str(tmp_path), "--quiet"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads((tmp_path / "faults.json").read_text())
    scenarios = {s["name"]: s for s in doc["scenarios"]}
    assert set(scenarios) == set(SHORT)
    for name, s in scenarios.items():
        assert s["attempted"] == s["iterations"] == 3, s
        assert (s["corrupt_bytes"], s["leaked_bytes"], s["hangs"], s["untyped_errors"],
                s["split_outcomes"]) == (0, 0, 0, 0, 0), (name, s["notes"])
        assert s["error_seconds_p99"] is None or s["error_seconds_p99"] < 10, s
    # The faults that must fail a push did, with the error a user can act on.
    assert scenarios["pool-full"]["failed_by_class"] == {"PoolFull": 3}
    assert scenarios["kill-receiver"]["restarts"] == 3
    assert scenarios["loss-1%"]["delivered_verified"] == 3
    assert "every scenario clean" in done.stdout

