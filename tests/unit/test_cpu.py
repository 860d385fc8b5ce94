"""The data path's CPU figures (kvwired.experiments.cpu): per write, per GiB, and
the rate one core's user time could post at."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvctl.figures import cpu_lines
from kvwired.experiments import cpu


def test_a_stretch_of_writes_gives_its_cost_per_write_and_per_gib() -> None:
    cost = cpu.WriteCost(size=512, writes=1_000_000, cpu=cpu.CpuTimes(user=2.0, system=0.5))
    assert cost.user_us_per_write == pytest.approx(2.0)
    assert cost.system_us_per_write == pytest.approx(0.5)
    # 1e6 writes of 512 B is 0.477 GiB: 2 s of user time is 4.19 s a GiB.
    assert cost.user_s_per_gib == pytest.approx(2.0 / (512e6 / (1 << 30)))
    # 512 B every 2 µs is 2.048 Gb/s.
    assert cost.one_core_gbps == pytest.approx(2.048)


def test_a_stretch_the_clock_did_not_see_has_no_line_rate() -> None:
    cost = cpu.WriteCost(size=2 << 20, writes=3, cpu=cpu.CpuTimes(0.0, 0.004))
    assert cost.one_core_gbps is None
    assert cost.user_us_per_write == 0.0


def test_figures_are_medians_of_rounds_under_one_prefix() -> None:
    rounds = [cpu.WriteCost(4096, 1000, cpu.CpuTimes(user, 0.001)) for user in (0.003, 0.001,
                                                                                  0.002)]
    figures = cpu.figures("stream_cpu", rounds)
    assert figures["stream_cpu_user_us_per_write"] == pytest.approx(2.0)
    assert figures["stream_cpu_system_us_per_write"] == pytest.approx(1.0)
    assert figures["stream_cpu_rounds_user_s_per_gib"] == [r.user_s_per_gib for r in rounds]
    assert figures["stream_cpu_one_core_gbps"] == pytest.approx(4096 * 8 / 2e-6 / 1e9)


def test_the_process_clocks_move_forward() -> None:
    before = cpu.own()
    sum(range(200_000))  # some user time
    spent = cpu.own() - before
    assert spent.user >= 0 and spent.system >= 0


@given(st.integers(1, 1 << 30), st.integers(1, 10**9), st.floats(1e-6, 1e4))
def test_one_core_rate_and_time_per_write_agree(size: int, writes: int, user: float) -> None:
    cost = cpu.WriteCost(size, writes, cpu.CpuTimes(user, 0.0))
    assert cost.one_core_gbps is not None
    # bits per write over seconds per write
    assert cost.one_core_gbps == pytest.approx(size * 8 / (cost.user_us_per_write * 1e-6) / 1e9)


def test_over_tcp_the_kernel_time_is_the_transports_own_and_counted() -> None:
    spent = cpu.CpuTimes(user=1.0, system=3.0)
    verbs = cpu.WriteCost(1 << 20, 1000, spent)
    tcp = cpu.WriteCost(1 << 20, 1000, spent, counts_kernel=True)
    assert verbs.counted == 1.0 and tcp.counted == 4.0
    assert verbs.one_core_gbps == pytest.approx(4 * tcp.one_core_gbps)  # type: ignore[operator]
    assert cpu.figures("s", [tcp])["s_counts_kernel"] is True


def test_a_busy_polling_tool_spends_a_core_for_each_write_it_times() -> None:
    spun = cpu.busy_polled(4096, writes_per_s=250_000)
    assert spun is not None and spun.user_us_per_write == pytest.approx(4.0)
    assert spun.one_core_gbps == pytest.approx(4096 * 8 * 250_000 / 1e9)
    assert cpu.busy_polled(4096, 0.0) is None  # it reported no rate


def _row(size: int, user_us: float, one_core: float | None, **more: object) -> dict[str, object]:
    return {"size": size, "stream_cpu_user_us_per_write": user_us,
            "stream_cpu_one_core_gbps": one_core, **more}


def test_the_demo_lines_quote_the_cpu_sizes_beside_perftest_and_scaled_to_the_host() -> None:
    rows = [_row(512, 25.5, 0.16, perftest_cpu_user_us_per_write=104.0, cpu_ratio=0.245),
            _row(2048, 18.6, 0.9),  # not a quoted size
            _row(2 << 20, 857.5, 19.6, perftest_cpu_user_us_per_write=111_000.0,
                 cpu_ratio=0.0077)]
    lines = cpu_lines(rows, slowdown=11.5)
    assert lines == [
        "sender CPU per write, kvwire vs ib_write_bw (which spins a core): "
        "512 B 25.50 vs 104.00 µs, x0.24; 2 MiB 857.50 vs 111000.00 µs, x0.01",
        "one core's user time could post: 512 B 0.2 Gb/s, 2 MiB 19.6 Gb/s",
        "... on one of this host's cores (the node's emulated core ran the same Python "
        "11.5x slower): 512 B 1.8 Gb/s, 2 MiB 225.4 Gb/s"]


def test_over_tcp_the_line_counts_system_time_and_is_not_scaled() -> None:
    rows = [_row(12 << 10, 1.6, 22.8, stream_cpu_counts_kernel=True)]
    assert cpu_lines(rows, slowdown=11.5) == [
        "one core's user and system time could post: 12 KiB 22.8 Gb/s"]
    assert cpu_lines([_row(4096, 1.0, 2.0)]) == []  # no quoted size: nothing to say
