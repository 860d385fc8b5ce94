"""The registry's view of the cluster, folded without I/O: records decode or
are rejected whole, events apply in revision order, and ``auto`` chooses
the connected receiver with the most free pool."""

from __future__ import annotations

import contextlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvwired.discovery.address import RegistryAddress
from kvwired.discovery.membership import (
    BadMemberRecord,
    Member,
    Membership,
    merged_peers,
)
from kvwired.errors import ConfigError

PROTOCOL = 3


def member(name: str = "decode-a", free: int = 100, protocol: int = PROTOCOL,
           control: str = "10.0.0.1:7471") -> Member:
    return Member(name=name, control=control, transport="verbs", protocol=protocol,
                  pool_bytes=1000, pool_free=free, identity="ab" * 32)


def test_a_record_round_trips() -> None:
    m = member()
    assert Member.decode("decode-a", m.encode()) == m


@pytest.mark.parametrize("raw", [
    b"", b"not json", b"[]", b"{}", b"\xff\xfe",
    json.dumps({**json.loads(member().encode()), "extra": 1}).encode(),
    json.dumps({**json.loads(member().encode()), "pool_free": True}).encode(),
    json.dumps({**json.loads(member().encode()), "pool_free": 2000}).encode(),
    json.dumps({**json.loads(member().encode()), "pool_free": -1}).encode(),
    json.dumps({**json.loads(member().encode()), "protocol": "3"}).encode(),
    json.dumps({**json.loads(member().encode()), "control": "nohost"}).encode(),
    json.dumps({**json.loads(member().encode()), "control": "h:99999"}).encode(),
    json.dumps({**json.loads(member().encode()), "transport": "carrier-pigeon"}).encode(),
    json.dumps({**json.loads(member().encode()), "name": "someone-else"}).encode(),
    b"{" + b" " * 5000 + b"}",
])
def test_an_adversarys_record_is_rejected_whole(raw: bytes) -> None:
    with pytest.raises(BadMemberRecord):
        Member.decode("decode-a", raw)


@settings(max_examples=300)
@given(st.binary(max_size=300))
def test_no_bytes_crash_the_decoder(raw: bytes) -> None:
    with contextlib.suppress(BadMemberRecord):
        Member.decode("decode-a", raw)


def test_a_bad_record_replaces_a_good_one_as_a_departure() -> None:
    view = Membership(PROTOCOL)
    assert view.put("decode-a", member().encode(), 5).joined == ["decode-a"]
    changes = view.put("decode-a", b"garbage", 6)
    assert changes.left == ["decode-a"] and changes.rejected
    assert view.peers() == {}


def test_events_older_than_the_snapshot_are_ignored() -> None:
    view = Membership(PROTOCOL)
    view.replace([("decode-a", member().encode())], revision=10)
    assert not view.delete("decode-a", 9)
    assert not view.put("decode-b", member("decode-b").encode(), 10)
    assert view.peers() == {"decode-a": "10.0.0.1:7471"}
    assert view.delete("decode-a", 11).left == ["decode-a"]


def test_a_snapshot_reports_who_joined_left_and_moved() -> None:
    view = Membership(PROTOCOL)
    view.replace([("a", member("a").encode()), ("b", member("b").encode())], 3)
    changes = view.replace([("b", member("b", control="10.0.0.9:7471").encode()),
                            ("c", member("c").encode())], 8)
    assert (changes.joined, changes.left, changes.moved) == (["c"], ["a"], ["b"])


def test_another_protocol_version_is_listed_but_not_a_peer() -> None:
    view = Membership(PROTOCOL)
    view.put("old", member("old", protocol=PROTOCOL - 1).encode(), 1)
    assert "old" in view.members and view.peers() == {}
    assert view.choose(["old"], "prefill") is None


def test_auto_takes_the_most_free_pool_among_the_connected() -> None:
    view = Membership(PROTOCOL)
    for rev, (name, free) in enumerate([("a", 10), ("b", 500), ("c", 900)], 1):
        view.put(name, member(name, free=free).encode(), rev)
    assert view.choose(["a", "b", "c"], "prefill") == "c"
    assert view.choose(["a", "b"], "prefill") == "b"  # c is not connected
    assert view.choose(["zz"], "prefill") is None


def test_ties_are_broken_per_sender_and_spread_senders_out() -> None:
    view = Membership(PROTOCOL)
    names = [f"decode-{i}" for i in range(8)]
    for rev, name in enumerate(names, 1):
        view.put(name, member(name, free=100).encode(), rev)
    picks = {view.choose(names, f"prefill-{i}") for i in range(32)}
    assert len(picks) > 1  # not every sender on the same receiver
    assert view.choose(names, "prefill-0") == view.choose(list(reversed(names)), "prefill-0")


def test_configured_peers_win_over_the_registry() -> None:
    assert merged_peers({"a": "1.1.1.1:1"}, {"a": "2.2.2.2:2", "b": "3.3.3.3:3"}) == {
        "a": "1.1.1.1:1", "b": "3.3.3.3:3"}


@pytest.mark.parametrize("url", ["etcd://h/c", "etcd://h:2379/c", "etcd://10.0.0.5:23/prod"])
def test_registry_addresses_parse(url: str) -> None:
    address = RegistryAddress.parse(url)
    assert address.cluster in ("c", "prod") and address.prefix.endswith(b"/receivers/")


@pytest.mark.parametrize("url", ["", "http://h:2379/c", "etcd://h:2379", "etcd://h:2379/",
                                 "etcd://:2379/c", "etcd://h:x/c", "etcd://h/a/b",
                                 "etcd://h/c?x=1"])
def test_bad_registry_addresses_say_what_to_write(url: str) -> None:
    with pytest.raises(ConfigError, match="etcd://HOST:PORT/CLUSTER"):
        RegistryAddress.parse(url)


class MembershipAgainstTheRegistry(RuleBasedStateMachine):
    """Random puts, deletes and snapshots, delivered out of order: the view
    always equals what the registry held at the newest revision applied."""

    def __init__(self) -> None:
        super().__init__()
        self.view = Membership(PROTOCOL)
        self.store: dict[str, bytes] = {}
        self.revision = 0
        self.history: list[tuple[int, str, bytes | None]] = []

    names = st.sampled_from(["a", "b", "c"])

    @rule(name=names, free=st.integers(0, 1000), garbage=st.booleans())
    def put(self, name: str, free: int, garbage: bool) -> None:
        self.revision += 1
        raw = b"junk" if garbage else member(name, free=free).encode()
        self.store[name] = raw
        self.history.append((self.revision, name, raw))
        self.view.put(name, raw, self.revision)

    @rule(name=names)
    def delete(self, name: str) -> None:
        self.revision += 1
        self.store.pop(name, None)
        self.history.append((self.revision, name, None))
        self.view.delete(name, self.revision)

    @rule(back=st.integers(1, 5))
    def replay_old_events(self, back: int) -> None:
        # A watch restarted from an older revision repeats events: no effect.
        for revision, name, raw in self.history[-back:]:
            if raw is None:
                self.view.delete(name, revision)
            else:
                self.view.put(name, raw, revision)

    @rule()
    def snapshot(self) -> None:
        self.view.replace(list(self.store.items()), self.revision)

    @invariant()
    def the_view_is_the_registry(self) -> None:
        valid = {}
        for name, raw in self.store.items():
            with contextlib.suppress(BadMemberRecord):
                valid[name] = Member.decode(name, raw)
        assert self.view.members == valid


TestMembershipAgainstTheRegistry = MembershipAgainstTheRegistry.TestCase
