"""The cluster registry on etcd: receivers announce themselves, senders watch.

``discovery = "etcd://HOST:PORT/CLUSTER"`` turns it on. Receivers keep one
record each under ``/kvwire/<cluster>/receivers/<name>``, bound to an etcd
lease of ``TTL`` seconds that they refresh every second: a receiver that
dies (SIGKILL, power) drops out of the registry when its lease expires, one
that stops cleanly withdraws its record at once. At each refresh a receiver
reads its record back and restores it if anyone else changed it, so an
overwritten or deleted record is wrong for at most a second. Senders read the prefix and
then watch it from the revision they read at, so no change falls between the
two.

The client is aetcd: asyncio-native (no thread per watch, unlike the
synchronous etcd3 client), maintained, and speaking etcd's v3 gRPC API that
Debian's etcd-server (3.4) serves.

When etcd cannot be reached both sides carry on from what they last saw
(a sender keeps its links, a receiver keeps serving), say so in logs and in
``kvwire_registry_up``, and start over (a new lease, a fresh read) when it
answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import aetcd
import structlog

from .address import RegistryAddress
from .membership import Changes, Member, Membership

log = structlog.get_logger("kvwired.discovery")

TTL = 5  # seconds a receiver's record outlives its last refresh
REFRESH_EVERY = 1.0  # seconds between lease refreshes, and at most one record update each
RETRY_EVERY = 1.0  # seconds between attempts while etcd does not answer
CALL_TIMEOUT = 2  # seconds one etcd call may take
HEALTH_EVERY = 2.0  # seconds between a watching sender's looks at whether etcd answers


class RegistryLink:
    """One daemon's connection to etcd, and whether it answers."""

    def __init__(self, address: RegistryAddress) -> None:
        self.address = address
        self.up = False
        self._client: aetcd.Client | None = None

    def client(self) -> aetcd.Client:
        if self._client is None:
            self._client = aetcd.Client(self.address.host, self.address.port,
                                        timeout=CALL_TIMEOUT)
        return self._client

    async def reset(self) -> None:
        """Drop the gRPC channel: the next call dials afresh."""
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.close(), CALL_TIMEOUT)

    def mark(self, up: bool, error: str = "") -> None:
        if up == self.up:
            return
        self.up = up
        if up:
            log.info("registry reachable", registry=str(self.address))
        else:
            log.warning("registry unreachable; working from the membership last seen",
                        registry=str(self.address), error=error,
                        hint="check that etcd runs there; kvwire re-registers when it answers")

    async def retrying(self, what: str, body: Callable[[], Awaitable[None]]) -> None:
        """Run ``body`` for ever; whenever etcd fails it, wait and start over."""
        while True:
            try:
                await body()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # grpc, aetcd and OS errors alike: etcd is away
                self.mark(False, f"{what}: {type(exc).__name__}: {exc}")
                await self.reset()
            await asyncio.sleep(RETRY_EVERY)

    async def close(self) -> None:
        await self.reset()


class Announcer:
    """Keeps a receiver's record in the registry while it runs."""

    def __init__(self, link: RegistryLink, describe: Callable[[], Member]) -> None:
        self.link = link
        self.describe = describe
        self._lease: Any = None

    async def run(self) -> None:
        await self.link.retrying("announce", self._announce)

    async def _announce(self) -> None:
        client = self.link.client()
        key = self.link.address.key(self.describe().name)
        self._lease = lease = await client.lease(TTL)
        published: bytes | None = None
        while True:
            member = self.describe()
            record = member.encode()
            # Read back on every refresh, not only when our figures change:
            # anyone who can write to etcd can overwrite or delete the record,
            # and a put without our lease would outlive us and never expire.
            stored = await client.get(key)
            if stored is None or stored.value != record or stored.lease != lease.id:
                if published is not None and (stored is None or stored.value != published
                                              or stored.lease != lease.id):
                    log.warning("registry record changed by someone else: restored",
                                key=key.decode(), found=_shown(stored),
                                hint="only this receiver may write its record; check who "
                                     "else writes to the registry")
                await client.put(key, record, lease=lease)
                if published is None:
                    log.info("registered", registry=str(self.link.address),
                             name=member.name, control=member.control, ttl=TTL)
                published = record
            reply = await lease.refresh()
            if reply is None or reply.TTL <= 0:
                # etcd was away longer than the TTL: the record is gone.
                raise ConnectionError("the registry lease expired")
            self.link.mark(True)
            await asyncio.sleep(REFRESH_EVERY)

    async def withdraw(self) -> None:
        """Take the record out now (a clean stop), rather than at lease expiry."""
        lease, self._lease = self._lease, None
        if lease is None or not self.link.up:
            return
        try:
            await asyncio.wait_for(lease.revoke(), CALL_TIMEOUT)
            log.info("deregistered", registry=str(self.link.address))
        except Exception as exc:  # etcd away: the lease expires by itself
            log.warning("could not deregister; the record expires with its lease",
                        error=str(exc), ttl=TTL)


class Watcher:
    """Folds the registry's receivers into ``membership`` and reports changes."""

    def __init__(self, link: RegistryLink, membership: Membership,
                 on_change: Callable[[Changes], None]) -> None:
        self.link = link
        self.membership = membership
        self.on_change = on_change

    async def run(self) -> None:
        await self.link.retrying("watch", self._watch)

    async def _watch(self) -> None:
        client = self.link.client()
        address = self.link.address
        snapshot = await client.get_prefix(address.prefix)
        self._report(self.membership.replace(
            [(address.name_of(kv.key), kv.value) for kv in snapshot],
            snapshot.header.revision))
        self.link.mark(True)
        watch = await client.watch_prefix(address.prefix,
                                          start_revision=snapshot.header.revision + 1)
        # A watch stream can sit silent on a dead connection; a health probe
        # beside it notices, and ends the watch so it starts over.
        health = asyncio.ensure_future(self._probe(client))
        try:
            async for event in _until(watch, health):
                name, revision = address.name_of(event.kv.key), event.kv.mod_revision
                if event.kind == aetcd.EventKind.PUT:
                    self._report(self.membership.put(name, event.kv.value, revision))
                else:
                    self._report(self.membership.delete(name, revision))
        finally:
            health.cancel()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(watch.cancel(), CALL_TIMEOUT)
        health.result()  # why the watch ended

    async def _probe(self, client: aetcd.Client) -> None:
        while True:
            await asyncio.sleep(HEALTH_EVERY)
            await client.status()

    def _report(self, changes: Changes) -> None:
        for key, why in changes.rejected:
            log.warning("registry record skipped", key=key, error=why)
        for key, reason, why in changes.refused:
            log.warning("registry record not believed: ignored", key=key, reason=reason,
                        error=why, hint="only a receiver of this cluster may write its own "
                        "record; check who else writes to the registry")
        if changes:
            log.info("membership changed", joined=changes.joined, left=changes.left,
                     moved=changes.moved, members=sorted(self.membership.members))
        self.on_change(changes)


def _shown(stored: Any) -> str:
    """What was found under a receiver's key, for the log (bounded)."""
    if stored is None:
        return "nothing (deleted)"
    value = bytes(stored.value)[:200].decode(errors="replace")
    return f"{value} (etcd lease {stored.lease or 'none'})"


async def _until(watch: Any, health: asyncio.Future[None]) -> Any:
    """The watch's events until the watch or the health probe ends."""
    events = watch.__aiter__()
    while True:
        nxt = asyncio.ensure_future(events.__anext__())
        done, _ = await asyncio.wait({nxt, health}, return_when=asyncio.FIRST_COMPLETED)
        if nxt not in done:
            nxt.cancel()
            return
        try:
            yield nxt.result()
        except StopAsyncIteration:
            raise ConnectionError("the registry ended the watch") from None


async def read_members(address: RegistryAddress) -> list[tuple[str, bytes]]:
    """The raw records under the cluster's prefix (``kvctl cluster``)."""
    link = RegistryLink(address)
    try:
        result = await link.client().get_prefix(address.prefix)
        return [(address.name_of(kv.key), kv.value) for kv in result]
    finally:
        await link.close()
