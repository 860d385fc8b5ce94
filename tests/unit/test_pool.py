from __future__ import annotations

import asyncio
import mmap
import os

import pytest

from kvwired.errors import ConfigError, PoolFull, RequestTooLarge
from kvwired.pool import PAGE, Pool, RangeAllocator, SharedMemory, map_shared_fd


def test_allocator_first_fit_alignment_and_merging() -> None:
    alloc = RangeAllocator(10 * PAGE)
    a = alloc.allocate(1)
    b = alloc.allocate(PAGE + 1)
    c = alloc.allocate(3 * PAGE)
    assert (a, b, c) == (0, PAGE, 3 * PAGE)
    assert a is not None and b is not None and c is not None
    assert alloc.used_bytes == 6 * PAGE
    assert alloc.allocate(5 * PAGE) is None
    alloc.free(b)
    assert alloc.allocate(2 * PAGE) == PAGE  # the hole is reused
    alloc.free(a)
    alloc.free(PAGE)
    alloc.free(c)
    assert alloc.used_bytes == 0
    assert alloc.allocate(10 * PAGE) == 0  # freed ranges merged back into one


def test_shared_memory_is_sealed_and_shareable() -> None:
    memory = SharedMemory(4 * PAGE, "test")
    try:
        memory.view[:5] = b"hello"
        with pytest.raises(PermissionError):
            os.ftruncate(memory.fd, PAGE)  # a client cannot shrink it under the daemon
        readonly = map_shared_fd(memory.readonly_fd(), memory.size, writable=False)
        assert readonly[:5] == b"hello"
        with pytest.raises(TypeError):
            readonly[0] = 0
        readonly.close()
        with pytest.raises(PermissionError):
            mmap.mmap(memory.readonly_fd(), memory.size, flags=mmap.MAP_SHARED)
    finally:
        memory.close()


def test_pool_size_must_be_whole_pages() -> None:
    with pytest.raises(ConfigError, match="page size"):
        SharedMemory(PAGE + 1, "odd")


async def test_reserve_waits_for_room_then_reports_pool_full() -> None:
    pool = Pool(4 * PAGE, "receive", full_hint="release something")
    first = await pool.reserve(3 * PAGE, wait=0.1)
    with pytest.raises(PoolFull, match="pool full") as info:
        await pool.reserve(2 * PAGE, wait=0.1)
    assert info.value.hint == "release something"
    waiter = asyncio.create_task(pool.reserve(2 * PAGE, wait=5))
    for _ in range(3):  # let it run until it waits for room
        await asyncio.sleep(0)
    assert not waiter.done()
    pool.release(first)
    second = await asyncio.wait_for(waiter, 1)
    assert second.offset == 0
    pool.close()


async def test_request_larger_than_pool_is_refused_at_once() -> None:
    pool = Pool(4 * PAGE, "receive")
    with pytest.raises(RequestTooLarge, match="cannot fit"):
        await pool.reserve(5 * PAGE, wait=60)
    pool.close()
