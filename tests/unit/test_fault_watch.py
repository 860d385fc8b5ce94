"""The fault campaign's per-push watcher, fed events with no processes."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from kvctl.faults.watch import GATE, Kill, PushWatch, Release, Strike

KINDS = ["subscribed", "connected", "opened", "layer", "verified", "finished", "released",
         "failed", "exit", "mid-push"]


def _watch(decode_hold: str | None = None, prefill_hold: str | None = None,
           at_hold: bool = False) -> PushWatch:
    return PushWatch({"decode": decode_hold, "prefill": prefill_hold},
                     strikes_at_hold=at_hold, hang=30.0, last=0.0, decode_grace=10.0)


def test_a_clean_push_opens_the_gate_once_and_both_sides_end() -> None:
    watch = _watch()
    assert watch.event("decode", 1.0, {"e": "subscribed"}, now=1.0) == [Release("prefill", GATE)]
    assert watch.struck == 1.0, "no hold point: the fault strikes as the push starts"
    assert watch.event("prefill", 2.0, {"e": "opened"}, now=2.0) == []
    assert watch.event("prefill", 3.0, {"e": "finished", "checksum": 7}, now=3.0) == []
    assert watch.event("decode", 3.1, {"e": "verified", "corrupt": 0}, now=3.1) == []
    assert not watch.done
    watch.event("decode", 3.2, {"e": "released"}, now=3.2)
    assert watch.done and not watch.hung
    assert watch.endings == {"prefill": {"e": "finished", "checksum": 7, "at": 3.0},
                             "decode": {"e": "released", "at": 3.2, "corrupt": 0}}


def test_an_engine_at_its_hold_point_strikes_the_fault_once_then_is_let_go() -> None:
    watch = _watch(prefill_hold="mid-push", at_hold=True)
    watch.event("decode", 1.0, {"e": "subscribed"}, now=1.0)
    assert watch.struck is None
    assert watch.event("prefill", 2.0, {"e": "mid-push"}, now=2.5) == [Strike("prefill")]
    assert watch.struck == 2.5
    # Reaching it again (a retried push) only lets it go on.
    assert watch.event("prefill", 3.0, {"e": "mid-push"}, now=3.0) == [Release("prefill")]


def test_a_hold_without_a_fault_there_is_let_go_at_once() -> None:
    watch = _watch(decode_hold="layer")
    assert watch.event("decode", 1.0, {"e": "layer"}, now=1.0) == [Release("decode")]


def test_a_push_refused_before_its_lease_must_reach_decode_within_the_grace() -> None:
    watch = _watch()
    watch.event("decode", 1.0, {"e": "subscribed"}, now=1.0)
    watch.event("prefill", 2.0, {"e": "failed", "error": "PoolFull"}, now=2.0)
    assert watch.tick(now=11.0) == [], "still within the grace"
    assert watch.tick(now=12.5) == [Kill("decode")]
    assert watch.endings["decode"] == {"e": "not-told", "at": 12.5} and watch.done


def test_a_killed_engines_exit_says_so_and_silence_past_the_bound_is_a_hang() -> None:
    watch = _watch()
    watch.event("decode", 1.0, {"e": "exit"}, now=1.0, killed=True)
    assert watch.endings["decode"] == {"e": "killed", "at": 1.0}
    assert watch.tick(now=20.0) == [] and not watch.hung
    watch.tick(now=31.5)
    assert watch.hung and watch.done


events_st = st.lists(st.tuples(st.sampled_from(["decode", "prefill"]),
                               st.sampled_from(KINDS), st.booleans()), max_size=40)


@given(events_st, st.sampled_from([None, "mid-push", "layer"]), st.booleans())
def test_any_events_end_each_side_once_strike_once_and_open_the_gate_once(
        events: list[tuple[str, str, bool]], hold: str | None, at_hold: bool) -> None:
    watch = _watch(decode_hold=hold, prefill_hold=hold, at_hold=at_hold)
    strikes = gates = 0
    first_endings: dict[str, dict[str, Any]] = {}
    for n, (role, kind, killed) in enumerate(events):
        event: dict[str, Any] = {"e": kind, "corrupt": 0} if kind == "verified" else {"e": kind}
        actions = watch.event(role, float(n), event, now=float(n), killed=killed)
        strikes += sum(isinstance(a, Strike) for a in actions)
        gates += actions.count(Release("prefill", GATE))
        for side, ending in watch.endings.items():
            first_endings.setdefault(side, ending)
            assert watch.endings[side] is first_endings[side], "a side ends once"
    assert strikes <= 1 and gates <= 1
    assert (watch.struck is not None) == (strikes == 1 if at_hold else gates == 1)
    assert all(e["e"] in ("finished", "released", "failed", "exit", "killed")
               for e in watch.endings.values())
