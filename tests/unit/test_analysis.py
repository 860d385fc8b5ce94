"""The experiments' arithmetic against cases worked out by hand."""

from __future__ import annotations

import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvwired import analysis


def test_percentiles_are_nearest_rank() -> None:
    samples = [float(n) for n in range(1, 1001)]  # 1 .. 1000, shuffled below
    shuffled = samples[::2] + samples[1::2]
    assert analysis.percentile(shuffled, 50) == 500.0  # rank ceil(0.5 * 1000) = 500
    assert analysis.percentile(shuffled, 99) == 990.0
    assert analysis.percentile(shuffled, 99.9) == 999.0
    assert analysis.percentile(shuffled, 100) == 1000.0
    assert analysis.percentile(shuffled, 0) == 1.0
    # Few samples: the tail percentiles are the largest sample, never beyond it.
    assert analysis.percentile([3.0, 1.0, 2.0], 99.9) == 3.0
    assert analysis.percentile([3.0, 1.0, 2.0], 50) == 2.0  # rank ceil(1.5) = 2
    with pytest.raises(ValueError):
        analysis.percentile([], 50)
    with pytest.raises(ValueError):
        analysis.percentile([1.0], 101)


@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=300),
       st.floats(0, 100))
def test_a_percentile_is_the_smallest_sample_with_q_percent_at_or_below_it(
        samples: list[float], q: float) -> None:
    value = analysis.percentile(samples, q)
    assert value in samples
    n = len(samples)
    # Rounded as the rank is: 99.9 % of 1,000 is 999 samples, not 999.0000000000001.
    needed = round(q * n / 100, 9)
    assert sum(s <= value for s in samples) >= needed
    assert sum(s < value for s in samples) < max(needed, 1)


def test_latency_is_half_the_round_trip_in_microseconds() -> None:
    lat = analysis.half_rtt_latency([0.000100, 0.000200, 0.000300, 0.000400])
    assert lat.samples == 4
    assert lat.min_us == pytest.approx(50.0)
    assert lat.p50_us == pytest.approx(100.0)  # rank 2 of 50, 100, 150, 200
    assert lat.p99_us == pytest.approx(200.0)
    assert lat.mean_us == pytest.approx(125.0)


def test_gbps() -> None:
    assert analysis.gbps(48 << 20, 1.0) == pytest.approx(0.402653184)
    assert analysis.gbps(125_000_000, 1.0) == pytest.approx(1.0)
    assert analysis.gbps(1, 0.0) == 0.0


def test_knee_is_the_smallest_size_reaching_90_percent_of_peak() -> None:
    bandwidth = {512: 1.0, 2048: 4.0, 8192: 8.9, 65536: 9.5, 1 << 20: 10.0, 8 << 20: 9.8}
    assert analysis.knee(bandwidth) == 65536  # 9.5 >= 9.0; 8.9 is not
    assert analysis.knee(bandwidth, fraction=0.5) == 8192
    assert analysis.knee({}) is None
    assert analysis.knee({512: 0.0}) is None
    # A noisy dip after the knee does not move it.
    assert analysis.knee({512: 1.0, 4096: 9.2, 8192: 7.0, 16384: 10.0}) == 4096


def test_recommended_chunk_is_the_knee_when_it_fits_a_layer() -> None:
    layer = 2 << 20
    chunk, why = analysis.recommend_chunk({512: 1.0, 65536: 9.5, layer: 10.0}, layer)
    assert chunk == 65536 and "90%" in why


def test_recommended_chunk_stays_within_a_layer_when_the_knee_is_beyond() -> None:
    layer = 2 << 20
    bandwidth = {512: 1.0, 1 << 20: 7.0, layer: 8.0, 48 << 20: 10.0}
    chunk, why = analysis.recommend_chunk(bandwidth, layer)
    assert chunk == layer  # the knee (48 MiB) would delay every layer's event
    assert "beyond one layer" in why and "80% of peak" in why


def test_ideal_speedup_peaks_on_the_ridge_below_two() -> None:
    # 24 layers: the first compute and the last transfer are never hidden.
    assert analysis.ideal_speedup(0.0, 1.0, 24) == 1.0
    assert analysis.ideal_speedup(1.0, 1.0, 24) == pytest.approx(48 / 25)
    assert analysis.ideal_speedup(0.5, 1.0, 24) == pytest.approx(36 / 24.5)
    assert analysis.ideal_speedup(2.0, 1.0, 24) == analysis.ideal_speedup(1.0, 2.0, 24)
    assert analysis.ideal_speedup(0.0, 0.0, 24) == 1.0
    assert analysis.ideal_speedup(1.0, 1.0, 1) == 1.0  # one layer: nothing overlaps
    # Many layers: the double-buffering limit (Tc + Tx) / max(Tc, Tx).
    assert analysis.ideal_speedup(1.0, 1.0, 10**9) == pytest.approx(2.0)
    assert analysis.ideal_speedup(4.0, 1.0, 10**9) == pytest.approx(1.25)


@given(st.floats(0, 1e3), st.floats(0, 1e3), st.integers(1, 1024))
def test_ideal_speedup_lies_between_one_and_two(tc: float, tx: float, layers: int) -> None:
    ideal = analysis.ideal_speedup(tc, tx, layers)
    assert 1.0 - 1e-9 <= ideal <= 2.0 + 1e-9
    # More layers never lower what overlap can save.
    assert analysis.ideal_speedup(tc, tx, layers + 1) >= ideal - 1e-9


def test_efficiency_is_measured_over_ideal() -> None:
    assert analysis.efficiency(1.7, 2.0) == pytest.approx(0.85)
    assert analysis.efficiency(1.25, 1.25) == pytest.approx(1.0)
    assert analysis.efficiency(1.0, 0.0) == 0.0


def test_side_of_the_ridge() -> None:
    assert analysis.bound_side(0.6e-3, 0.84e-3) == "network-bound"
    assert analysis.bound_side(2e-3, 1e-3) == "compute-bound"
    assert analysis.bound_side(1.02e-3, 1e-3) == "balanced"  # within 5 %
    assert set(analysis.SIDE_MEANING) == {"network-bound", "compute-bound", "balanced"}


def test_ratio() -> None:
    assert analysis.ratio(0.219, 0.172) == pytest.approx(1.2733, rel=1e-3)
    assert analysis.ratio(None, 1.0) is None
    assert analysis.ratio(1.0, 0.0) is None


_durations = st.floats(0, 1e3, allow_nan=False, allow_infinity=False)


@given(_durations, _durations, st.integers(1, 64), st.integers(2, 8))
def test_a_steady_link_overlaps_to_the_ideal(tc: float, tx: float, layers: int,
                                             buffers: int) -> None:
    overlapped = analysis.overlapped_seconds(tc, [tx] * layers, buffers)
    assert overlapped == pytest.approx(layers * max(tc, tx) + min(tc, tx), rel=1e-9, abs=1e-9)
    if tc + tx > 0:
        assert analysis.jitter_ceiling(tc, [tx], layers, buffers, draws=3) == pytest.approx(
            analysis.ideal_speedup(tc, tx, layers), rel=1e-9)


@given(_durations, st.lists(_durations, min_size=1, max_size=48), st.integers(1, 6))
def test_the_overlapped_schedule_obeys_its_bounds(tc: float, transfers: list[float],
                                                  buffers: int) -> None:
    overlapped = analysis.overlapped_seconds(tc, transfers, buffers)
    sequential = len(transfers) * tc + sum(transfers)
    slack = 1e-9 * max(1.0, sequential)
    # Never slower than one layer at a time, never faster than either side alone.
    assert overlapped <= sequential + slack
    assert overlapped >= tc + sum(transfers) - slack
    assert overlapped >= len(transfers) * tc + transfers[-1] - slack
    # One more buffer never slows it; one buffer is the sequential schedule.
    assert analysis.overlapped_seconds(tc, transfers, buffers + 1) <= overlapped + slack
    assert analysis.overlapped_seconds(tc, transfers, 1) == pytest.approx(sequential, abs=slack)


def test_a_jittery_link_lowers_the_ceiling_and_more_buffers_raise_it() -> None:
    # Tx of 1 on average, but each layer takes 0.7 or 1.3: at the ridge a
    # late layer stalls the compute and an early one idles the link.
    samples = [0.7, 1.3]
    double = analysis.jitter_ceiling(1.0, samples, 24, buffers=2)
    triple = analysis.jitter_ceiling(1.0, samples, 24, buffers=3)
    assert double < triple < analysis.ideal_speedup(1.0, 1.0, 24)
    assert double == analysis.jitter_ceiling(1.0, samples, 24, buffers=2)  # seeded
    # Far from the ridge, jitter has little left to cost.
    assert analysis.jitter_ceiling(4.0, samples, 24) == pytest.approx(
        analysis.ideal_speedup(4.0, 1.0, 24), rel=0.01)


def test_a_ceiling_needs_samples_and_a_schedule_needs_a_buffer() -> None:
    with pytest.raises(ValueError, match="transfer samples"):
        analysis.jitter_ceiling(1.0, [], 24)
    with pytest.raises(ValueError, match="at least one buffer"):
        analysis.overlapped_seconds(1.0, [1.0], 0)


_rounds = st.lists(st.floats(1e-3, 1e3), min_size=1, max_size=9)


@given(_rounds)
def test_the_spread_contains_the_median(rounds: list[float]) -> None:
    figure = analysis.spread(rounds)
    assert figure is not None
    if len(rounds) == 1:  # one round says nothing about how steady it is
        assert figure.low is figure.high is None and figure.to_wire() is None
        assert not figure.wider_than_effect()
    else:
        assert figure.low is not None and figure.high is not None
        assert figure.low <= figure.median <= figure.high
        assert figure.to_wire() == [min(rounds), max(rounds)]


def test_no_rounds_no_figure() -> None:
    assert analysis.spread([]) is None


def test_a_spread_wider_than_the_effect_is_said_to_be() -> None:
    assert not analysis.Spread(1.30, 1.25, 1.40).wider_than_effect()
    assert analysis.Spread(1.04, 0.81, 1.30).wider_than_effect()  # both sides of 1
    assert analysis.Spread(1.10, 1.01, 1.35).wider_than_effect()  # 0.34 wide, 0.10 away
    assert analysis.Spread(0.57, 0.55, 0.60).wider_than_effect() is False


@given(st.dictionaries(st.integers(1, 1 << 26), _rounds, min_size=1, max_size=10))
def test_the_knee_lies_within_the_sizes_it_could_be(rounds: dict[int, list[float]]) -> None:
    medians = {size: statistics.median(r) for size, r in rounds.items()}
    knee = analysis.knee(medians)
    could_be = analysis.knee_range(rounds)
    assert could_be is not None and knee is not None
    earliest, latest = could_be
    assert earliest <= knee <= latest
    line = 0.9 * max(medians.values())
    # Nothing smaller than the earliest had a single round reaching the line.
    assert all(max(r) < line for size, r in rounds.items() if size < earliest)


def test_rounds_that_agree_pin_the_knee() -> None:
    rounds = {512: [0.1, 0.1], 8192: [0.5, 0.5], 65536: [1.0, 1.0]}
    assert analysis.knee_range(rounds) == (65536, 65536)
    wobbly = {512: [0.1, 0.1], 8192: [0.6, 0.95], 65536: [0.85, 1.0], 1 << 20: [0.95, 1.0]}
    assert analysis.knee_range(wobbly) == (8192, 1 << 20)
