"""Per-lease keys on a TCP responder: each grants one lease's range, as a
memory window does on an RDMA device, checked as each write's header is
parsed. A revoked key is remembered for a while, to tell a late write from
a forged one in the error."""

from __future__ import annotations

import secrets
import time

from ...errors import RemoteAccessError

REMEMBERED = 1024  # revoked keys kept to name in errors


class LeaseKeys:
    """The keys one responder granted, by key: each one's [start, end)."""

    def __init__(self, region_key: int) -> None:
        self._region_key = region_key  # never handed out as a lease's
        self._grants: dict[int, tuple[int, int]] = {}
        self._revoked: dict[int, float] = {}

    def grant(self, offset: int, length: int) -> int:
        while True:
            key = secrets.randbits(32)
            if key and key not in self._grants and key != self._region_key:
                break
        self._grants[key] = (offset, offset + length)
        return key

    def revoke(self, key: int) -> None:
        if self._grants.pop(key, None) is not None:
            self._revoked[key] = time.monotonic()
            if len(self._revoked) > REMEMBERED:
                del self._revoked[next(iter(self._revoked))]

    def check(self, key: int, offset: int, length: int) -> None:
        span = self._grants.get(key)
        if span is None:
            revoked = self._revoked.get(key)
            raise RemoteAccessError(
                f"remote access error: a write of {length} B at {offset} under key {key:#x}, "
                + (f"revoked {(time.monotonic() - revoked) * 1e3:.1f} ms ago when its lease "
                   "ended" if revoked is not None else "never granted to this sender"))
        if offset < span[0] or length < 0 or offset + length > span[1]:
            raise RemoteAccessError(
                f"remote access error: a write of {length} B at {offset} is outside the "
                f"{span[1] - span[0]} B at {span[0]} its key grants")

    def clear(self) -> None:
        self._grants.clear()
