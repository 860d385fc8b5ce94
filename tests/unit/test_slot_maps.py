"""A prefill engine's slot mappings: what a push writes lands in its slot, what a
view kept past the push's end writes never does, and retired pages carry later
pushes whose slots they cover (kvwired.slot_maps)."""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwired.pool import PAGE
from kvwired.slot_maps import MAX_PARKED, SlotMaps

POOL_PAGES = 64


@pytest.fixture
def pool() -> Iterator[tuple[SlotMaps, mmap.mmap]]:
    fd = os.memfd_create("slot-maps-test")
    os.ftruncate(fd, POOL_PAGES * PAGE)
    whole = mmap.mmap(fd, POOL_PAGES * PAGE, flags=mmap.MAP_SHARED)  # the daemon's view
    maps = SlotMaps(fd)
    yield maps, whole
    maps.close()
    whole.close()
    os.close(fd)


def test_a_push_writes_its_slot_and_a_kept_view_writes_nothing_after(
        pool: tuple[SlotMaps, mmap.mmap]) -> None:
    maps, whole = pool
    slot, view = maps.take(4 * PAGE, 3 * PAGE)
    view[:] = b"\x01" * view.nbytes
    assert whole[4 * PAGE : 7 * PAGE] == b"\x01" * (3 * PAGE)
    stale = view[:PAGE]  # an engine's careless copy, kept past the end
    view.release()
    maps.retire(slot)
    stale[:] = b"\xee" * PAGE
    assert whole[4 * PAGE : 5 * PAGE] == b"\x01" * PAGE
    assert maps.parked == 1

    again, view = maps.take(4 * PAGE, 3 * PAGE)
    assert maps.reused == 1 and maps.parked == 0
    view[:] = b"\x02" * view.nbytes
    stale[:] = b"\xef" * PAGE
    assert whole[4 * PAGE : 7 * PAGE] == b"\x02" * (3 * PAGE)
    view.release()
    maps.retire(again)


def test_a_parked_mapping_carries_a_smaller_slot_inside_it(
        pool: tuple[SlotMaps, mmap.mmap]) -> None:
    maps, whole = pool
    slot, view = maps.take(0, 8 * PAGE)
    view.release()
    maps.retire(slot)
    inner, view = maps.take(5 * PAGE, PAGE + 100)  # not page-sized: the tail is unused
    assert maps.reused == 1
    view[:] = b"\x03" * view.nbytes
    assert whole[5 * PAGE : 6 * PAGE + 100] == b"\x03" * (PAGE + 100)
    assert whole[6 * PAGE + 100 : 6 * PAGE + 101] == b"\x00"
    view.release()
    maps.retire(inner)
    outside, view = maps.take(8 * PAGE, PAGE)  # covered by nothing parked: mapped anew
    assert maps.reused == 1
    view.release()
    maps.retire(outside)


def test_at_most_max_parked_are_kept(pool: tuple[SlotMaps, mmap.mmap]) -> None:
    maps, _ = pool
    for n in range(MAX_PARKED + 3):
        slot, view = maps.take(n * PAGE, PAGE)
        view.release()
        maps.retire(slot)
    assert maps.parked == MAX_PARKED
    # The oldest went first: slot 0 is mapped anew, the newest is reused.
    slot, view = maps.take(0, PAGE)
    view.release()
    maps.retire(slot)
    assert maps.reused == 0
    slot, view = maps.take((MAX_PARKED + 2) * PAGE, PAGE)
    view.release()
    maps.retire(slot)
    assert maps.reused == 1


def test_a_push_retired_after_close_is_not_parked(pool: tuple[SlotMaps, mmap.mmap]) -> None:
    maps, whole = pool
    slot, view = maps.take(3 * PAGE, PAGE)
    stale = view[:16]
    view.release()
    maps.close()  # its connection closed while the push was still open
    maps.retire(slot)
    stale[:] = b"\xee" * 16
    assert whole[3 * PAGE : 3 * PAGE + 16] == bytes(16)
    assert maps.parked == 0


def test_where_pages_cannot_move_each_push_maps_its_slot(
        pool: tuple[SlotMaps, mmap.mmap]) -> None:
    maps, whole = pool
    maps._can_move = False  # as on a kernel before 5.13
    for value in (1, 2):
        slot, view = maps.take(2 * PAGE, PAGE)
        stale = view[:16]
        view[:] = bytes([value]) * PAGE
        view.release()
        maps.retire(slot)
        stale[:] = b"\xee" * 16
        assert whole[2 * PAGE : 3 * PAGE] == bytes([value]) * PAGE
    assert maps.parked == 0 and maps.reused == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, POOL_PAGES - 1), st.integers(1, 4 * PAGE)),
                min_size=1, max_size=24))
def test_any_sequence_of_pushes_lands_where_each_was_given(
        slots: list[tuple[int, int]]) -> None:
    fd = os.memfd_create("slot-maps-property")
    os.ftruncate(fd, POOL_PAGES * PAGE)
    whole = mmap.mmap(fd, POOL_PAGES * PAGE, flags=mmap.MAP_SHARED)
    maps = SlotMaps(fd)
    kept = []
    try:
        for n, (page, length) in enumerate(slots):
            offset = page * PAGE
            length = min(length, POOL_PAGES * PAGE - offset)
            slot, view = maps.take(offset, length)
            mark = bytes([n % 250 + 1])
            view[:] = mark * length
            kept.append(view[:1])
            view.release()
            maps.retire(slot)
            for stale in kept:  # every view ever handed out writes nowhere now
                stale[:] = b"\xff"
            assert whole[offset : offset + length] == mark * length
    finally:
        for stale in kept:
            stale.release()
        maps.close()
        whole.close()
        os.close(fd)
