"""Who is in the cluster, as the registry last told us: no I/O.

Receivers publish a :class:`Member` record under ``<cluster>/receivers/<name>``
in the registry, bound to a lease that expires a few seconds after the
receiver stops refreshing it. :class:`Membership` folds the registry's
snapshots and change events into the set of members a sender should be
connected to, and chooses a receiver for ``peer="auto"``.

The registry is shared ground: anything that can write to it can write a
record there. A record that does not decode is skipped and reported, never
trusted in part. With TLS, a receiver signs its record with its node key
and carries its certificate in it; a sender that is handed a ``check``
believes only records that pass it (kvwired.discovery.seal), and one that
fails is *refused*: reported, counted, and ignored, the member as last
believed staying. Whether the node behind a record is who it claims to be
is settled again by the control connection's mutual TLS.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, get_type_hints

from ..errors import KvwireError
from ..protocol import AUTO_PEER

MAX_RECORD_BYTES = 4096


class BadMemberRecord(KvwireError, code="bad_member_record",
                      hint="the record in the registry was not written by a kvwire receiver "
                           "of a compatible version; delete it, or upgrade the receiver"):
    """A registry record that is not a valid :class:`Member`."""


@dataclass(frozen=True)
class Member:
    """A receiver as it announces itself in the registry."""

    name: str
    control: str  # HOST:PORT of its control listener
    transport: str  # "verbs" or "tcp"
    protocol: int  # its PROTOCOL_VERSION
    pool_bytes: int
    pool_free: int
    identity: str = ""  # SHA-256 of its TLS certificate, "" without TLS
    certificate: str = ""  # its TLS certificate, PEM ("" without TLS)
    signature: str = ""  # base64 ECDSA by its node key over ``signed_body`` ("" without TLS)

    def encode(self) -> bytes:
        # JSON, so `etcdctl get --prefix` shows an operator what is there.
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    def signed_body(self) -> bytes:
        """What the signature covers: every field but the signature itself."""
        fields = asdict(self)
        del fields["signature"]
        return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, key_name: str, raw: bytes) -> Member:
        """The record stored under ``.../<key_name>``; :class:`BadMemberRecord` if
        it is not one."""
        if len(raw) > MAX_RECORD_BYTES:
            raise BadMemberRecord(f"record {key_name!r} is {len(raw)} bytes, more than "
                                  f"{MAX_RECORD_BYTES}")
        try:
            fields: Any = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadMemberRecord(f"record {key_name!r} is not JSON: {exc}") from None
        if not isinstance(fields, dict) or set(fields) != set(_FIELDS):
            raise BadMemberRecord(f"record {key_name!r} does not have the fields "
                                  f"{sorted(_FIELDS)}")
        for name, kind in _FIELDS.items():
            value = fields[name]
            # bool is an int to Python, and never a valid count here.
            if not isinstance(value, kind) or isinstance(value, bool):
                raise BadMemberRecord(f"record {key_name!r}: {name} is not a {kind.__name__}")
        member = cls(**fields)
        member.validate(key_name)
        return member

    def validate(self, key_name: str) -> None:
        if self.name != key_name or not _is_name(self.name) or self.name == AUTO_PEER:
            raise BadMemberRecord(f"record {key_name!r} names the receiver {self.name!r}")
        host, sep, port = self.control.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise BadMemberRecord(f"record {key_name!r}: control {self.control!r} is not "
                                  "HOST:PORT")
        if self.transport not in ("verbs", "tcp"):
            raise BadMemberRecord(f"record {key_name!r}: unknown transport "
                                  f"{self.transport!r}")
        if not 0 <= self.pool_free <= self.pool_bytes:
            raise BadMemberRecord(f"record {key_name!r}: pool_free {self.pool_free} is "
                                  f"not within the pool's {self.pool_bytes} bytes")


# Every field of a record and its JSON type, read off Member itself.
_FIELDS: dict[str, type] = get_type_hints(Member)


def _is_name(name: str) -> bool:
    return 0 < len(name) <= 64 and all(c.isalnum() or c in "-_." for c in name)


# A record's check: None to believe it, else (reason label, what is wrong).
RecordCheck = Callable[[Member], tuple[str, str] | None]


@dataclass
class Changes:
    joined: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)
    moved: list[str] = field(default_factory=list)  # a new control address
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (key, why)
    # Records that decoded but failed the check, ignored: (key, reason, why).
    refused: list[tuple[str, str, str]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.joined or self.left or self.moved)


class Membership:
    """The receivers of one cluster, folded from registry snapshots and events.

    Receivers that speak another protocol version are kept (``kvctl cluster``
    shows them) but not offered as peers: a connection would be refused.
    """

    def __init__(self, protocol: int, check: RecordCheck | None = None) -> None:
        self.protocol = protocol
        self.check = check
        self.members: dict[str, Member] = {}
        self.revision = 0  # the registry revision this view is current to

    def replace(self, records: Iterable[tuple[str, bytes]], revision: int) -> Changes:
        """Start over from a full snapshot (after a reconnect, say)."""
        fresh: dict[str, Member] = {}
        changes = Changes()
        for name, raw in records:
            member = self._decode(name, raw, changes)
            if member is _REFUSED:
                if name in self.members:  # believed before: it stays as it was
                    fresh[name] = self.members[name]
            elif isinstance(member, Member):
                fresh[name] = member
        for name in self.members.keys() - fresh.keys():
            changes.left.append(name)
        for name, member in fresh.items():
            self._note(self.members.get(name), member, changes)
        self.members = fresh
        self.revision = max(self.revision, revision)
        return changes

    def put(self, name: str, raw: bytes, revision: int) -> Changes:
        changes = Changes()
        if revision <= self.revision:
            return changes  # already in the snapshot this view was built from
        self.revision = revision
        member = self._decode(name, raw, changes)
        if member is _REFUSED:
            return changes  # not believed: the member stays as last believed
        if not isinstance(member, Member):
            # A record we cannot read is no receiver of ours: drop the old one.
            if self.members.pop(name, None) is not None:
                changes.left.append(name)
            return changes
        self._note(self.members.get(name), member, changes)
        self.members[name] = member
        return changes

    def delete(self, name: str, revision: int) -> Changes:
        changes = Changes()
        if revision <= self.revision:
            return changes
        self.revision = revision
        if self.members.pop(name, None) is not None:
            changes.left.append(name)
        return changes

    def peers(self) -> dict[str, str]:
        """Name to control address, for every member a sender can talk to."""
        return {name: m.control for name, m in sorted(self.members.items())
                if m.protocol == self.protocol}

    def choose(self, connected: Iterable[str], chooser: str) -> str | None:
        """The connected member with the most free pool (None: no member is).

        Ties go to the highest rendezvous hash of (``chooser``, member): each
        sender breaks them the same way every time, and different senders
        spread over the tied receivers instead of all picking the first name.
        """
        live = [self.members[n] for n in connected
                if n in self.members and self.members[n].protocol == self.protocol]
        if not live:
            return None
        best = max(live, key=lambda m: (m.pool_free, _rendezvous(chooser, m.name)))
        return best.name

    def _decode(self, name: str, raw: bytes, changes: Changes) -> Member | _Refused | None:
        """The record as a Member; None if it does not decode, ``_REFUSED`` if it
        decodes but fails the check."""
        try:
            member = Member.decode(name, raw)
        except BadMemberRecord as exc:
            changes.rejected.append((name, exc.message))
            return None
        if self.check is not None and (refusal := self.check(member)) is not None:
            changes.refused.append((name, *refusal))
            return _REFUSED
        return member

    @staticmethod
    def _note(old: Member | None, new: Member, changes: Changes) -> None:
        if old is None:
            changes.joined.append(new.name)
        elif old.control != new.control:
            changes.moved.append(new.name)


class _Refused:
    """A record that decoded and was not believed."""


_REFUSED = _Refused()


def _rendezvous(chooser: str, member: str) -> bytes:
    return hashlib.sha256(f"{chooser}\0{member}".encode()).digest()


def merged_peers(static: Mapping[str, str], discovered: Mapping[str, str]) -> dict[str, str]:
    """The sender's peer list: its configured ``[peers]`` win over the registry's."""
    return {**discovered, **static}
