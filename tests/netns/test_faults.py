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
from kvctl.faults.campaign import Campaign, ScenarioResult
from kvctl.faults.engine import corrupt_bytes, failure
from kvctl.faults.reference import DEADLINE_FACTOR, DEADLINE_FLOOR, WireReference
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


def test_a_decode_engine_left_untold_spoils_the_scenario() -> None:
    result = _account({"prefill": {"e": "failed", "class": "PoolFull", "typed": True,
                                   "message": "staging pool full", "at": 1.0},
                       "decode": {"e": "not-told", "at": 11.0}})
    assert result.not_told == 1 and not result.clean


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


def test_scenarios_are_selected_by_name_and_a_wrong_name_says_which_exist() -> None:
    assert [s.name for s in select(list(SHORT), "tcp")] == list(SHORT)
    assert len(select(None, "tcp")) == len(SCENARIOS)
    with pytest.raises(UsageError, match="no fault scenario named nope") as info:
        select(["nope"], "tcp")
    assert "kill-receiver" in (info.value.hint or "")
    assert len({s.name for s in SCENARIOS}) == len(SCENARIOS)
    for scenario in SCENARIOS:
        assert scenario.kind in ("wire", "process", "resource")
        assert bool(scenario.netem or scenario.blackout or scenario.data_cut
                    or scenario.action), scenario


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


def test_the_report_names_errors_slower_than_the_bar_and_says_what_ran(tmp_path: Path) -> None:
    slow = ScenarioResult("stop-receiver", "process", "verbs", 2, 2, 0,
                          error_seconds=[7.7, 12.3], seconds=61.0)
    assert "errors slower than 10 s: stop-receiver (12.3 s)" in report.render([slow])
    setup = {"where": "lab", "iterations": 2, "layers": 24, "push_bytes": 12 << 20}
    report.write([slow], tmp_path, setup)
    doc = json.loads((tmp_path / "faults.json").read_text())
    assert setup.items() <= doc.items() and doc["scenarios"][0]["seconds"] == 61.0


@given(st.one_of(st.none(), st.floats(min_value=0, max_value=1e5)))
def test_a_push_deadline_follows_the_wire_and_never_falls_below_the_floor(
        seconds: float | None) -> None:
    deadline = WireReference("ib_write_bw", 12 << 20, seconds).deadline
    assert deadline >= DEADLINE_FLOOR
    if seconds is None:  # a wire the tool could not cross: the floor, and a note why
        assert deadline == DEADLINE_FLOOR
    else:
        assert deadline >= DEADLINE_FACTOR * seconds
        assert deadline == DEADLINE_FLOOR or deadline == DEADLINE_FACTOR * seconds


def test_a_wire_scenario_is_reported_beside_the_plain_tool_on_the_same_wire() -> None:
    slow = ScenarioResult("delay-reorder", "wire", "verbs", 3, 3, 1, error_seconds=[9.5, 30.1],
                          reference=WireReference("ib_write_bw", 12 << 20, 77.0))
    slow.failed_by_class["PeerLost"] = 2
    text = report.render([slow])
    assert ("delay-reorder: ib_write_bw moved the push's 12 MiB in 77.00 s on this wire; "
            "pushes had 154 s; 1/3 delivered byte-exact; the rest ended PeerLost 2, "
            "9.5-30.1 s after the push began") in text
    stuck = ScenarioResult("loss-5%", "wire", "verbs", 1, 1, 0, reference=WireReference(
        "ib_write_bw", 12 << 20, None, "timed out after 300 s"))
    assert ("ib_write_bw did not move the push's 12 MiB on this wire (timed out after "
            "300 s); pushes had the 20 s floor") in report.render([stuck])
    assert stuck.to_dict()["wire_reference"] == {
        "tool": "ib_write_bw", "bytes": 12 << 20, "seconds": None,
        "why": "timed out after 300 s", "push_deadline": 20.0}


def test_between_namespaces_the_systemd_only_scenarios_say_why_they_do_not_run() -> None:
    from kvctl.faults.deployment import NetnsDeployment

    deployment = NetnsDeployment.__new__(NetnsDeployment)  # no namespaces needed to ask
    for scenario in SCENARIOS:
        reason = deployment.supports(scenario.action) if scenario.action else None
        if scenario.action in ("stall", "memlock"):
            assert reason and "lab" in reason, scenario
        else:
            assert reason is None, scenario


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
                s["split_outcomes"], s["decode_not_told"]) == (0, 0, 0, 0, 0, 0), (name,
                                                                           s["notes"])
        assert s["error_seconds_p99"] is None or s["error_seconds_p99"] < 10, s
    # The faults that must fail a push did, with the error a user can act on.
    assert scenarios["pool-full"]["failed_by_class"] == {"PoolFull": 3}
    assert scenarios["kill-receiver"]["restarts"] == 3
    assert scenarios["loss-1%"]["delivered_verified"] == 3
    # The wire scenario was measured with the plain socket loop on its own
    # wire first, and its pushes had the deadline that earned.
    reference = scenarios["loss-1%"]["wire_reference"]
    assert reference["tool"] == "socket loop" and reference["bytes"] == doc["push_bytes"]
    assert reference["seconds"] > 0
    assert reference["push_deadline"] == max(DEADLINE_FLOOR,
                                             DEADLINE_FACTOR * reference["seconds"])
    assert "loss-1%: socket loop moved the push's" in done.stdout
    assert scenarios["pool-full"]["wire_reference"] is None  # not a wire fault
    # A data stream gone silent ends its push, typed, within the bound above
    # (it used to hang with its deadline never firing).
    stalled = scenarios["stalled-stream"]
    assert stalled["delivered_verified"] == 0 and sum(stalled["failed_by_class"].values()) == 3
    # An engine that stopped waiting still hears one outcome, the decode
    # engine's: aborted, or delivered before its abort arrived.
    cancelled = scenarios["cancel-wait"]
    assert cancelled["delivered_verified"] + sum(cancelled["failed_by_class"].values()) == 3
    assert set(cancelled["failed_by_class"]) <= {"RequestAborted"}, cancelled
    assert "every scenario clean" in done.stdout



@pytest.mark.netns
@pytest.mark.skipif(_why_not is not None, reason=_why_not or "")
def test_the_wire_reference_crosses_the_faulted_wire(tmp_path: Path) -> None:
    """The socket loop runs between the namespaces on the wire as the fault
    leaves it: a clean wire is crossed, a dead one is reported, not waited on."""
    from kvctl.faults.deployment import NetnsDeployment

    with NetnsDeployment(tmp_path) as deployment:
        clean = deployment.wire_reference(64 << 10, 4)
        deployment.wire("loss 100%")
        try:
            dead = deployment.wire_reference(64 << 10, 4, limit=3)
        finally:
            deployment.wire(None)
    assert clean.seconds is not None and clean.total_bytes == 256 << 10, clean
    assert (dead.seconds, dead.why, dead.deadline) == (None, "not done in 3 s", DEADLINE_FLOOR)


class _ServerOutput:
    """A fork server's stdout, sorted by child as it is read."""

    def __init__(self, server: subprocess.Popen[str]) -> None:
        self.server = server
        self.events: dict[str, list[dict[str, Any]]] = {}

    def _read_one(self) -> None:
        assert self.server.stdout is not None
        line = self.server.stdout.readline()
        assert line, "the fork server ended early"
        child, _, text = line.rstrip("\n").partition(" ")
        self.events.setdefault(child, []).append(json.loads(text))

    def of(self, child: str, until: str) -> list[dict[str, Any]]:
        """``child``'s events, read until its first ``until``."""
        while not any(e["e"] == until for e in self.events.get(child, [])):
            self._read_one()
        return self.events[child]


def _command(directory: Path, child: str, argv: list[str]) -> None:
    staged = directory / f"{child}.tmp"
    staged.write_text(json.dumps(argv))
    staged.rename(directory / f"{child}.cmd")  # whole, as the lab's host side writes it


def test_the_fork_server_forks_one_real_engine_process_per_command(tmp_path: Path) -> None:
    import os
    import signal
    import socket

    commands = tmp_path / "commands"
    mute = socket.socket(socket.AF_UNIX)  # takes connections into its backlog, never answers
    mute.bind(str(tmp_path / "mute.sock"))
    mute.listen(8)
    server = subprocess.Popen([sys.executable, "-m", "kvctl.faults.forkserver", str(commands)],
                              stdout=subprocess.PIPE, text=True)
    output = _ServerOutput(server)
    try:
        assert output.of("server", "ready") == [{"e": "ready", "pid": server.pid}]
        _command(commands, "lost", ["decode", "--socket", str(tmp_path / "none.sock"),
                                    "--req", "r", "--seed", "1"])
        _command(commands, "stuck", ["prefill", "--socket", str(tmp_path / "mute.sock"),
                                     "--req", "r", "--seed", "1"])
        # An engine with no daemon: its own typed failure, then its exit code.
        lost = output.of("lost", "exit")
        assert [e["e"] for e in lost] == ["pid", "failed", "exit"]
        assert lost[1]["typed"] and lost[2]["code"] == 1
        # An engine stuck in its daemon's handshake is a process of its own: a
        # SIGKILL ends it alone, and the server says so.
        pid = output.of("stuck", "pid")[0]["pid"]
        assert pid not in (server.pid, os.getpid(), lost[0]["pid"])
        os.kill(pid, signal.SIGKILL)
        assert output.of("stuck", "exit")[-1] == {"e": "exit", "code": -signal.SIGKILL}
        assert server.poll() is None
        (commands / "stop").touch()
        assert server.wait(timeout=30) == 0
    finally:
        if server.poll() is None:
            server.kill()
        server.wait()
        mute.close()
