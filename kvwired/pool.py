"""Shared, pre-faulted memory pools and the allocator that carves them into slots.

A pool is one memfd mapped by the daemon and, through the fd passed over a
unix socket, by local engines: the prefill engine writes KV straight into
the sender's staging pool and the decode engine reads it in place from the
receiver's pool. The memfd is sealed against resizing, because a client that
shrank it would make the daemon die of SIGBUS on its next access.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import fcntl
import mmap
import os
from dataclasses import dataclass

from .errors import ConfigError, PoolFull, RequestTooLarge

PAGE = mmap.PAGESIZE


def align_up(n: int, align: int = PAGE) -> int:
    return (n + align - 1) // align * align


class RangeAllocator:
    """First-fit allocator of page-aligned ranges ("slots") in ``[0, size)``.

    Free ranges are kept sorted by offset and merged with their neighbours
    on free, so a pool emptied of leases is one free range again.
    """

    def __init__(self, size: int, align: int = PAGE) -> None:
        self.size = size
        self.align = align
        self._free_offsets: list[int] = [0] if size else []
        self._free_lengths: dict[int, int] = {0: size} if size else {}
        self._used: dict[int, int] = {}

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    @property
    def leases(self) -> int:
        return len(self._used)

    def allocate(self, length: int) -> int | None:
        need = align_up(max(length, 1), self.align)
        for offset in self._free_offsets:
            free = self._free_lengths[offset]
            if free >= need:
                self._free_offsets.remove(offset)
                del self._free_lengths[offset]
                if free > need:
                    self._insert_free(offset + need, free - need)
                self._used[offset] = need
                return offset
        return None

    def free(self, offset: int) -> None:
        length = self._used.pop(offset)
        self._insert_free(offset, length)
        self._merge_around(offset)

    def _insert_free(self, offset: int, length: int) -> None:
        bisect.insort(self._free_offsets, offset)
        self._free_lengths[offset] = length

    def _merge_around(self, offset: int) -> None:
        i = self._free_offsets.index(offset)
        if i + 1 < len(self._free_offsets):
            nxt = self._free_offsets[i + 1]
            if offset + self._free_lengths[offset] == nxt:
                self._free_lengths[offset] += self._free_lengths.pop(nxt)
                del self._free_offsets[i + 1]
        if i > 0:
            prev = self._free_offsets[i - 1]
            if prev + self._free_lengths[prev] == offset:
                self._free_lengths[prev] += self._free_lengths.pop(offset)
                del self._free_offsets[i]


class SharedMemory:
    """A sealed memfd of ``size`` bytes, mapped read-write and pre-faulted."""

    def __init__(self, size: int, name: str) -> None:
        if size <= 0 or size % PAGE:
            raise ConfigError(
                f"pool size {size} B is not a positive multiple of the page size ({PAGE} B)"
            )
        self.size = size
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            fcntl.fcntl(
                self.fd,
                fcntl.F_ADD_SEALS,
                fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL,
            )
            # MAP_POPULATE faults every page in now: the pool is resident
            # before the first request, as a registered RDMA region would be.
            self.map = mmap.mmap(
                self.fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE
            )
        except OSError:
            os.close(self.fd)
            raise
        self.view = memoryview(self.map)

    def readonly_fd(self) -> int:
        """A new fd on the same memory that can only be mapped for reading."""
        return os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)

    def close(self) -> None:
        """Give the memory back: the descriptor now, and the mapping unless a
        view of it is still held somewhere (then when the pool is dropped,
        or at a later close()). Safe to call again."""
        with contextlib.suppress(BufferError):
            self.view.release()
            self.map.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def map_shared_fd(fd: int, size: int, *, writable: bool) -> mmap.mmap:
    """Map a pool fd received from a daemon (and close the fd: the map keeps it)."""
    try:
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Slot:
    offset: int
    length: int


class Pool:
    """Shared memory plus slot allocation, with waiting for room to free up."""

    def __init__(self, size: int, name: str, size_key: str = "pool_size",
                 full_hint: str = "") -> None:
        self.memory = SharedMemory(size, name)
        self.size_key = size_key  # the config key users change to resize it
        self.full_hint = full_hint or f"raise {size_key}"
        self.allocator = RangeAllocator(size)
        self._freed = asyncio.Event()
        self.name = name

    @property
    def size(self) -> int:
        return self.memory.size

    @property
    def used_bytes(self) -> int:
        return self.allocator.used_bytes

    def try_reserve(self, length: int) -> Slot | None:
        self._check_fits(length)
        offset = self.allocator.allocate(length)
        return None if offset is None else Slot(offset, length)

    async def reserve(self, length: int, wait: float) -> Slot:
        """A slot of ``length`` bytes, waiting up to ``wait`` seconds for room."""
        self._check_fits(length)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while True:
            slot = self.try_reserve(length)
            if slot is not None:
                return slot
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise PoolFull(
                    f"{self.name} pool full: no {length} B free within {wait:g} s "
                    f"({self.used_bytes} of {self.size} B held by "
                    f"{self.allocator.leases} requests)",
                    hint=self.full_hint,
                )
            freed = self._freed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(freed.wait(), remaining)

    def release(self, slot: Slot) -> None:
        self.allocator.free(slot.offset)
        # Wake every waiter once; each retries its own allocation.
        self._freed.set()
        self._freed = asyncio.Event()

    def _check_fits(self, length: int) -> None:
        if align_up(length) > self.size:
            raise RequestTooLarge(
                f"a request of {length} B cannot fit the {self.name} pool of {self.size} B",
                hint=f"raise {self.size_key} or split the request",
            )

    def close(self) -> None:
        self.memory.close()
