"""The progress estimate: plans, the fit of what a link's units cost, what is left,
how progress shows it in a log or pipe; and a perftest server seen listening."""

from __future__ import annotations

import io
import socket

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvctl import progress
from kvctl.lab.demo import Relay
from kvctl.progress import PhaseProgress
from kvwired.experiments import perftest
from kvwired.experiments.plan import Estimate, PlannedPhase, fit_costs
from kvwired.experiments.spec import SweepParams

from ..waiting import until

_UNITS = ("writes", "bytes", "startups", "round_trips", "exchanged")
_costs = st.tuples(st.floats(1e-7, 1e-2), st.floats(1e-10, 1e-7), st.floats(1e-2, 5.0),
                   st.floats(1e-5, 1e-1), st.floats(1e-10, 1e-7))
_phases = st.lists(st.builds(PlannedPhase, st.just("p"), st.integers(0, 100_000),
                             st.integers(0, 1 << 26), st.integers(0, 3),
                             st.integers(0, 10_000), st.integers(0, 1 << 26)),
                   min_size=0, max_size=12)


def _seconds(costs: tuple[float, ...], phase: PlannedPhase) -> float:
    return sum(c * u for c, u in zip(costs, phase.units(), strict=True))


@given(_costs, _phases)
def test_once_each_unit_has_shown_its_cost_what_is_left_is_exact(
        costs: tuple[float, ...], rest: list[PlannedPhase]) -> None:
    # A first phase per unit, each about a second of that unit alone.
    telling = [PlannedPhase(unit, **{unit: max(1, round(1.0 / cost))})
               for unit, cost in zip(_UNITS, costs, strict=True)]
    estimate = Estimate([*telling, *rest])
    for phase in telling:
        estimate.begin(phase.phase)
        estimate.finish(_seconds(costs, phase))
    expected = sum(_seconds(costs, p) for p in rest)
    left = estimate.remaining(fraction_done=1.0)
    assert left == pytest.approx(expected, rel=1e-6, abs=1e-9)


def test_a_first_phase_does_not_foresee_hours() -> None:
    # A sweep's first phases: round trips of 512 B, perftest beside them, then
    # streaming. Read as the cost of bytes, the round trips' wait made the
    # estimate swing to 35 minutes; the simplest fit that explains them does not.
    sweep = SweepParams(peer="decode", iters=300, latency_bytes=32 << 20,
                        stream_bytes=32 << 20, baseline="perftest")
    plan = sweep.phases()
    estimate = Estimate(plan)
    seen = {"latency 512 B": 0.3, "perftest latency 512 B": 2.5, "stream 512 B": 1.7}
    for phase in plan[:7]:
        estimate.begin(phase.phase)
        estimate.finish(seen[phase.phase])
    left = estimate.remaining(1.0)
    assert left is not None and left < 20 * 60


@given(st.lists(st.tuples(st.floats(0, 1e6), st.floats(0, 1e9), st.floats(0, 5),
                          st.floats(0, 1e4), st.floats(0, 1e9)), min_size=1, max_size=8),
       st.lists(st.floats(0, 600), min_size=8, max_size=8))
def test_a_cost_is_never_negative(units: list[tuple[float, ...]],
                                  times: list[float]) -> None:
    assert all(cost >= 0 for cost in fit_costs(units, times[:len(units)]))


def test_nothing_is_estimated_before_a_phase_has_finished() -> None:
    estimate = Estimate([PlannedPhase("a", 10), PlannedPhase("b", 10)])
    assert estimate.remaining() is None
    estimate.begin("a")
    assert estimate.remaining() is None
    estimate.finish(2.0)
    estimate.begin("b")
    assert estimate.remaining(0.5) == pytest.approx(1.0)


def test_a_repeated_name_moves_to_its_next_place_in_the_plan() -> None:
    plan = [PlannedPhase("latency 512 B"), PlannedPhase("perftest latency 512 B"),
            PlannedPhase("latency 512 B")]
    estimate = Estimate(plan)
    for expected, phase in enumerate(["latency 512 B", "perftest latency 512 B",
                                      "latency 512 B"]):
        estimate.begin(phase)
        assert estimate.position == expected
    estimate.begin("not in the plan")  # stays where it is
    assert estimate.position == 2


@pytest.mark.parametrize("baseline", ["", "perftest", "socket"])
def test_a_sweep_plans_every_round_of_every_size(baseline: str) -> None:
    params = SweepParams(peer="decode", sizes=(512, 2 << 20), iters=300,
                         latency_bytes=32 << 20, stream_bytes=32 << 20, baseline=baseline)
    names = [p.phase for p in params.phases()]
    per_size = {"": 3, "perftest": 13, "socket": 8}[baseline]
    assert len(names) == 2 * per_size
    if baseline == "perftest":
        assert names[:4] == ["latency 512 B", "perftest latency 512 B"] * 2
        assert names.count("perftest bandwidth 2 MiB") == 3
    # Where perftest's least (five writes) outweighs all the streaming, it runs
    # once, in the middle of the rounds.
    whole = SweepParams(peer="decode", sizes=(48 << 20,), stream_bytes=32 << 20,
                        baseline="perftest")
    assert [p.phase for p in whole.phases()].count("perftest bandwidth 48 MiB") == 1
    # The whole 48 MiB goes out once per delivery, at that size's writes.
    deliver = next(p for p in params.phases() if p.phase == "deliver 48 MiB at 512 B")
    assert deliver.bytes == 48 << 20 and deliver.writes == (48 << 20) // 512


def test_in_a_pipe_each_phase_is_a_line_with_the_time_taken_and_left() -> None:
    out = io.StringIO()
    plan = [PlannedPhase("one", 100), PlannedPhase("two", 100), PlannedPhase("three", 100)]
    with PhaseProgress(out, plan=plan) as shown:
        shown.update("one", 100, 100)
        shown.update("two", 50, 100)
        shown.update("three", 0, 100)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("  one: 100/100 in ") and "phase 1 of 3" in lines[0]
    assert "left" in lines[1] and "phase 2 of 3" in lines[1]
    assert len(lines) == 3


async def test_a_long_phase_still_prints_a_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress, "HEARTBEAT", 0.05)
    out = io.StringIO()
    with PhaseProgress(out) as shown:
        shown.update("deliver 48 MiB at 512 B", 0, 1)
        await until(lambda: "so far" in out.getvalue(), what="a heartbeat line")
    assert out.getvalue().startswith("  deliver 48 MiB at 512 B: 0/1 so far")


def test_the_relay_keeps_characters_split_across_chunks() -> None:
    shown = io.StringIO()
    relay = Relay(shown)
    encoded = "p50 µs\n".encode()
    for n in range(len(encoded)):  # "µ" is two bytes: arrive one at a time
        relay.write(encoded[n:n + 1])
    assert relay.text == shown.getvalue() == "p50 µs\n"


def test_a_listening_port_is_seen_and_a_closed_one_is_not() -> None:
    # The receiver answers a perftest request once its server listens.
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        port = server.getsockname()[1]
        assert not perftest.listening(port)  # bound, not listening
        server.listen()
        assert perftest.listening(port)
    assert not perftest.listening(port)


def test_bars_drawn_through_a_pipe_when_the_host_has_a_terminal(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The lab demo sets the variable in the node when the host's output is a
    # terminal: the node draws its bars into the pipe for that terminal.
    monkeypatch.setenv(progress.BARS_VARIABLE, "1")
    out = io.StringIO()
    with PhaseProgress(out, plan=[PlannedPhase("one", 10), PlannedPhase("two", 10)]) as shown:
        shown.update("one", 10, 10)
        shown.update("two", 5, 10)
    drawn = out.getvalue()
    assert "\x1b[" in drawn  # cursor and colour: a live display
    assert "one: 10/10 in " in drawn  # each finished phase, a line above the bars
