"""The fault campaign in the lab: verbs over Soft-RoCE, the daemons under the
nodes' systemd, the engines in the nodes (``make faults`` runs all of it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvctl.lab.machine import LabState

pytestmark = pytest.mark.lab

# One scenario, two iterations: engines start in seconds on the emulated
# nodes, so the whole campaign is `make faults`, not `make test`.
SCENARIOS = ["kill-receiver"]


def test_a_short_campaign_in_the_lab_is_clean(lab: LabState, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "kvctl", "run", "faults", "--where", "lab",
                           "--scenarios", ",".join(SCENARIOS), "--iterations", "2",
                           "--out", str(tmp_path), "--quiet"],
                          capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads((tmp_path / "faults.json").read_text())
    scenarios = {s["name"]: s for s in doc["scenarios"]}
    assert list(scenarios) == SCENARIOS
    for name, s in scenarios.items():
        assert s["transport"] == "verbs" and s["attempted"] == 2, s
        assert (s["corrupt_bytes"], s["leaked_bytes"], s["hangs"], s["untyped_errors"],
                s["split_outcomes"]) == (0, 0, 0, 0, 0), (name, s["notes"])
        assert s["error_seconds_p99"] is None or s["error_seconds_p99"] < 10, s
    # systemd brought the killed receiver back each time.
    assert scenarios["kill-receiver"]["restarts"] == 2
    # Killed mid-push: the engines hear it as a typed error within seconds.
    assert scenarios["kill-receiver"]["failed_by_class"], scenarios["kill-receiver"]
