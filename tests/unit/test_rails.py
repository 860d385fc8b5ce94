"""Rail health: a failed rail is left out for a growing backoff, then tried again."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvwired.sender.rails import FIRST_BACKOFF, MAX_BACKOFF, RailHealth, replacement_rail

RAILS = ["rxe0", "rxe1", "rxe2"]


def test_a_failed_rail_is_left_out_then_due_again() -> None:
    health = RailHealth()
    assert not health.left_out_any
    health.failed("rxe1", now=100.0)
    assert health.left_out_any
    assert health.usable(RAILS, 100.0) == ["rxe0", "rxe2"]
    assert health.left_out(100.0) == {"rxe1": FIRST_BACKOFF}
    assert health.worth_retrying(RAILS, ["rxe0", "rxe2"], 100.0 + FIRST_BACKOFF - 0.1) == []
    assert health.worth_retrying(RAILS, ["rxe0", "rxe2"], 100.0 + FIRST_BACKOFF) == ["rxe1"]
    assert health.usable(RAILS, 100.0 + FIRST_BACKOFF) == RAILS
    # In use again (its probe passed): nothing is due any more.
    health.proven("rxe1")
    assert health.worth_retrying(RAILS, RAILS, 1000.0) == []
    assert not health.left_out_any


def test_a_rail_that_keeps_failing_waits_longer_up_to_a_minute() -> None:
    health = RailHealth()
    waits = []
    now = 0.0
    for _ in range(8):
        health.failed("rxe0", now)
        waits.append(health.left_out(now)["rxe0"])
        now += waits[-1]
    assert waits == [5.0, 10.0, 20.0, 40.0, 60.0, 60.0, 60.0, 60.0]
    health.proven("rxe0")
    health.failed("rxe0", now)
    assert health.left_out(now)["rxe0"] == FIRST_BACKOFF  # a new failure starts over


def test_with_every_rail_left_out_all_are_used() -> None:
    health = RailHealth()
    for rail in RAILS:
        health.failed(rail, 0.0)
    assert health.usable(RAILS, 1.0) == RAILS
    assert health.usable([], 1.0) == []


@given(st.lists(st.tuples(st.sampled_from(RAILS), st.floats(0, 1000),
                          st.booleans()), max_size=30),
       st.floats(0, 100))
def test_usable_is_never_empty_and_only_names_known_rails(
        events: list[tuple[str, float, bool]], later: float) -> None:
    health = RailHealth()
    now = max((when for _, when, _ in events), default=0.0) + later
    for rail, when, failed in sorted(events, key=lambda e: e[1]):
        if failed:
            health.failed(rail, when)
        else:
            health.proven(rail)
    usable = health.usable(RAILS, now)
    assert usable and set(usable) <= set(RAILS)
    assert all(0 < wait <= MAX_BACKOFF for wait in health.left_out(now).values())
    # A rail left out now is not usable unless every rail is left out.
    left = set(health.left_out(now))
    assert set(usable) == (set(RAILS) - left or set(RAILS))


def test_a_replacement_moves_off_a_rail_only_while_it_is_left_out() -> None:
    assert replacement_rail("rxe1", ["rxe0", "rxe1"], 1) == "rxe1"
    assert replacement_rail("rxe1", ["rxe0"], 1) == "rxe0"
    assert replacement_rail("rxe1", [], 1) == "rxe1"  # nowhere else to go
    assert replacement_rail("", ["rxe0"], 0) == ""  # no rails: the control path's device


@given(st.sampled_from(["", "rxe0", "rxe1", "rxe2"]),
       st.lists(st.sampled_from(["rxe0", "rxe1", "rxe2"]), unique=True), st.integers(0, 15))
def test_a_replacement_rail_is_its_own_or_a_usable_one(rail: str, usable: list[str],
                                                       number: int) -> None:
    chosen = replacement_rail(rail, usable, number)
    assert chosen == rail or chosen in usable
    assert (chosen != rail) == bool(rail and usable and rail not in usable)
