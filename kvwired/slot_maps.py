"""A prefill engine's writable mappings of its staging slots, kept warm between pushes.

Each push writes through a mapping of its own slot. When the push ends that
mapping is retired: its address is pointed at private anonymous memory in
place (``mmap(MAP_FIXED)``), so a view the engine kept past the end writes
where nobody reads and never into a later push that reuses the slot.

A mapping's cost is its page tables. For a 48 MiB push, populating them took
2.7 ms and tearing them down 1.5 ms: more than a sixth of the time TCP takes
to move those bytes between two namespaces, and on a real NIC several times
the transfer itself. So retiring moves the page tables instead of dropping
them: ``mremap(MREMAP_DONTUNMAP)`` carries the populated pages to a fresh
address and leaves the old range mapped with none, and only then is the old
range replaced with anonymous memory. The moved mapping is parked; the next
push whose slot lies inside a parked mapping writes through it at once.
Kernels before 5.13 cannot move a shared mapping this way, and then every
push maps its slot anew, as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
from dataclasses import dataclass

import structlog

from .pool import align_up

log = structlog.get_logger("kvwired.slot_maps")

# Parked mappings cost their page tables (8 B a 4 KiB page) and an address
# range each; a few cover what a sender's slots are reused as.
MAX_PARKED = 16

_MAP_FIXED = 0x10  # <sys/mman.h>; not exposed by the mmap module
_MREMAP_MAYMOVE = 1
_MREMAP_FIXED = 2
_MREMAP_DONTUNMAP = 4
_MAP_FAILED = ctypes.c_void_p(-1).value
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.mremap.restype = ctypes.c_void_p
_libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int,
                         ctypes.c_void_p]


def map_slot(fd: int, offset: int, length: int) -> mmap.mmap:
    """A writable, populated mapping of ``length`` bytes of a pool fd at page-aligned
    ``offset``."""
    return mmap.mmap(fd, align_up(length), flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                     prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)


def _address(mapping: mmap.mmap) -> int:
    anchor = (ctypes.c_char * len(mapping)).from_buffer(mapping)
    address = ctypes.addressof(anchor)
    del anchor  # no export of ours may outlive the call
    return address


def retire_mapping(mapping: mmap.mmap) -> None:
    """Point ``mapping``'s pages at private anonymous memory, in place.

    Views an engine kept (memoryviews, numpy arrays over them) stay valid
    Python objects, but what is written through them lands in memory nobody
    reads: never in the pool slot, which may already carry another request.
    ``MAP_FIXED`` replaces the pages atomically, with no window in which the
    address is unmapped.
    """
    if mapping.closed:
        return
    length = len(mapping)
    address = _address(mapping)
    result = _libc.mmap(ctypes.c_void_p(address), ctypes.c_size_t(length),
                        mmap.PROT_READ | mmap.PROT_WRITE,
                        mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED, -1, 0)
    if result is None or result == _MAP_FAILED or result != address:
        raise OSError(ctypes.get_errno(), "mmap(MAP_FIXED) failed retiring a staging view")
    # Close it now if nobody holds a view; otherwise the last view's end does.
    with contextlib.suppress(BufferError):
        mapping.close()


@dataclass
class SlotMap:
    """A writable mapping of ``[offset, offset + length)`` of the staging pool."""

    mapping: mmap.mmap
    offset: int
    length: int  # page-aligned

    def covers(self, offset: int, length: int) -> bool:
        return self.offset <= offset and offset + length <= self.offset + self.length


class SlotMaps:
    """One connection's slot mappings: taken by a push, retired when it ends.

    ``fd`` is the staging pool's, which the connection owns; ``close`` unmaps
    what is parked before the connection closes it.
    """

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._parked: list[SlotMap] = []  # oldest first
        self._can_move = True  # until the kernel says otherwise
        self.reused = 0  # pushes that wrote through a parked mapping

    @property
    def parked(self) -> int:
        return len(self._parked)

    def take(self, offset: int, length: int) -> tuple[SlotMap, memoryview]:
        """A mapping covering the slot, and the slot's ``length`` bytes in it."""
        for i, parked in enumerate(self._parked):
            if parked.covers(offset, length):
                del self._parked[i]
                self.reused += 1
                start = offset - parked.offset
                return parked, memoryview(parked.mapping)[start : start + length]
        slot = SlotMap(map_slot(self._fd, offset, length), offset, align_up(length))
        return slot, memoryview(slot.mapping)[:length]

    def retire(self, slot: SlotMap) -> None:
        """Take the slot's memory away from every view made of it (the caller
        has released its own), keeping its populated pages for a later push."""
        if slot.mapping.closed:
            return
        moved = self._move_pages(slot) if self._can_move else None
        retire_mapping(slot.mapping)
        if moved is None:
            return
        self._parked.append(moved)
        while len(self._parked) > MAX_PARKED:
            self._parked.pop(0).mapping.close()

    def _move_pages(self, slot: SlotMap) -> SlotMap | None:
        """The slot's pages, page tables and all, at a new address; None if the
        kernel cannot move a shared mapping and keep the old range."""
        target = mmap.mmap(-1, slot.length)  # the new address, unmapped by its close()
        result = _libc.mremap(ctypes.c_void_p(_address(slot.mapping)), slot.length,
                              slot.length,
                              _MREMAP_MAYMOVE | _MREMAP_FIXED | _MREMAP_DONTUNMAP,
                              ctypes.c_void_p(_address(target)))
        if result is None or result == _MAP_FAILED:
            target.close()
            self._can_move = False
            log.info("staging slots are mapped per push: this kernel cannot move a shared "
                     "mapping (mremap MREMAP_DONTUNMAP needs Linux 5.13)",
                     errno=ctypes.get_errno())
            return None
        return SlotMap(target, slot.offset, slot.length)

    def close(self) -> None:
        # A push that ends after this (its connection broke) is retired in
        # place: nothing would unmap a mapping parked from now on.
        self._can_move = False
        for parked in self._parked:
            with contextlib.suppress(BufferError):
                parked.mapping.close()
        self._parked.clear()
