"""Signed registry records (kvwired.discovery.seal): a receiver seals its
record with its node key; a sender believes only records sealed by a
receiver of its own cluster under its own name. An adversary who can write
to etcd but holds no receiver's key is refused, counted, and ignored."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvctl.keys import local_cluster
from kvwired.config import ReceiverConfig
from kvwired.discovery.membership import Member, Membership
from kvwired.discovery.seal import check_record, checker, seal
from kvwired.pool import Pool
from kvwired.receiver import ReceiverDaemon
from kvwired.trust import Trust

PROTOCOL = 5


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Trust]:
    root = tmp_path_factory.mktemp("tls")
    nodes = {"decode-a": "receiver", "decode-b": "receiver", "prefill": "sender"}
    dirs = local_cluster(root, nodes)
    stranger = local_cluster(root / "other-cluster", {"decode-a": "receiver"})
    trusts = {name: Trust(str(path), name) for name, path in dirs.items()}
    trusts["stranger"] = Trust(str(stranger["decode-a"]), "decode-a")
    return trusts


Forge = Callable[[dict[str, Trust]], Member]


def ca(cluster: dict[str, Trust]) -> x509.Certificate:
    """The cluster's CA, as a sender of the cluster holds it."""
    certificate = cluster["prefill"].ca_certificate
    assert certificate is not None
    return certificate


def record(trust: Trust, name: str = "decode-a", free: int = 100) -> Member:
    return Member(name=name, control="10.0.0.1:7471", transport="tcp", protocol=PROTOCOL,
                  pool_bytes=1000, pool_free=free, identity=trust.fingerprint)


def test_a_sealed_record_is_believed_after_a_round_trip(cluster: dict[str, Trust]) -> None:
    sealed = seal(record(cluster["decode-a"]), cluster["decode-a"])
    again = Member.decode("decode-a", sealed.encode())
    assert check_record(again, ca(cluster)) is None


@pytest.mark.parametrize(("forge", "reason"), [
    # An overwrite of the record by someone without the key: its fields change.
    (lambda c: dataclasses.replace(seal(record(c["decode-a"]), c["decode-a"]),
                                   control="10.6.6.6:7471"), "bad_signature"),
    (lambda c: dataclasses.replace(seal(record(c["decode-a"]), c["decode-a"]),
                                   pool_free=1000, pool_bytes=1000), "bad_signature"),
    (lambda c: record(c["decode-a"]), "unsigned"),
    # decode-b's key and certificate cannot speak for decode-a.
    (lambda c: seal(dataclasses.replace(record(c["decode-b"]), name="decode-a"),
                    c["decode-b"]), "wrong_name"),
    # Another cluster's CA issued this one, under the right name.
    (lambda c: seal(record(c["stranger"]), c["stranger"]), "not_from_ca"),
    # A sender's certificate is not a receiver's.
    (lambda c: seal(dataclasses.replace(record(c["prefill"]), name="prefill"), c["prefill"]),
     "not_a_receiver"),
    # The identity must be the certificate carried.
    (lambda c: dataclasses.replace(seal(record(c["decode-a"]), c["decode-a"]),
                                   identity="00" * 32), "bad_certificate"),
])
def test_a_forged_record_is_refused_with_its_reason(cluster: dict[str, Trust], forge: Forge,
                                                    reason: str) -> None:
    refusal = check_record(forge(cluster), ca(cluster))
    assert refusal is not None and refusal[0] == reason, refusal


@settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(["name", "control", "transport", "protocol", "pool_bytes",
                              "pool_free", "identity", "certificate", "signature"]),
       data=st.data())
def test_no_change_to_any_field_of_a_sealed_record_is_believed(
        cluster: dict[str, Trust], field: str, data: st.DataObject) -> None:
    sealed = seal(record(cluster["decode-a"]), cluster["decode-a"])
    original = getattr(sealed, field)
    if isinstance(original, int):
        value: Any = data.draw(st.integers(0, 1 << 40).filter(lambda v: v != original))
    else:
        value = data.draw(st.text(max_size=40).filter(lambda v: v != original))
    forged = dataclasses.replace(sealed, **{field: value})
    assert check_record(forged, ca(cluster)) is not None


def test_a_refused_record_leaves_the_member_as_last_believed(
        cluster: dict[str, Trust]) -> None:
    membership = Membership(PROTOCOL, checker(cluster["prefill"]))
    genuine = seal(record(cluster["decode-a"]), cluster["decode-a"])
    changes = membership.replace([("decode-a", genuine.encode())], revision=1)
    assert changes.joined == ["decode-a"]
    forged = dataclasses.replace(genuine, control="10.6.6.6:7471", pool_free=1000)
    changes = membership.put("decode-a", forged.encode(), revision=2)
    assert not changes and changes.refused[0][:2] == ("decode-a", "bad_signature")
    assert membership.members["decode-a"] == genuine
    # A snapshot holding the forgery keeps the member as believed, too.
    changes = membership.replace([("decode-a", forged.encode())], revision=3)
    assert not changes and membership.peers() == {"decode-a": "10.0.0.1:7471"}
    # A forged record for a receiver never believed adds nobody.
    stranger = seal(record(cluster["stranger"]), cluster["stranger"])
    changes = membership.put("decode-x", dataclasses.replace(
        stranger, name="decode-x").encode(), revision=4)
    assert "decode-x" not in membership.members and changes.refused


def test_a_receiver_re_signs_only_what_changed(tmp_path: Path) -> None:
    dirs = local_cluster(tmp_path, {"decode-a": "receiver"})
    daemon = ReceiverDaemon(ReceiverConfig(name="decode-a", tls_dir=str(dirs["decode-a"]),
                                           transport="tcp", listen="10.0.0.1:7471"))
    daemon.control_port = 7471
    daemon._pool = Pool(1 << 20, "receive")
    assert daemon.trust is not None and daemon.trust.ca_certificate is not None
    first, second = daemon.describe(), daemon.describe()
    assert first == second  # the same signature: no rewrite in etcd at each refresh
    assert check_record(first, daemon.trust.ca_certificate) is None
    daemon.pool.try_reserve(4096)  # its free pool changes: re-signed
    third = daemon.describe()
    assert third.pool_free == first.pool_free - 4096 and third.signature != first.signature
    assert check_record(third, daemon.trust.ca_certificate) is None
