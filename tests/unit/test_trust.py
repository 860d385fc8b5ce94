"""Who may talk to a receiver: mutual TLS under the cluster CA, names bound
to certificates, the `senders` list, bounded cost before authentication,
and credentials rotated without dropping sessions. An adversary's inputs,
each checked against what it must not reach: a lease, a key, the pool."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import ssl
from pathlib import Path
from typing import Any

import pytest
import structlog
from prometheus_client import generate_latest

from kvctl.keys import issue, local_cluster
from kvwired import checksum
from kvwired.cli import build_daemon
from kvwired.client import ReceiverClient, SenderClient
from kvwired.config import SenderConfig, build
from kvwired.errors import AccessDenied, AuthenticationFailed, ConfigError, PeerLost, PoolFull
from kvwired.protocol import CONTROL, FrameDecoder, RawMessage, encode, message
from kvwired.receiver import MAX_PEER_LABELS
from kvwired.trust import Trust

from ..conftest import LocalDaemons, start_local, until


def _refusals(local: LocalDaemons, reason: str, channel: str = "control") -> float:
    return float(local.receiver.metrics.auth_failures.labels(channel, reason)._value.get())


async def _push_ok(local: LocalDaemons, req: str, peer: str = "decode") -> None:
    data = os.urandom(1 << 20)
    async with await SenderClient.connect(local.sender_socket) as client:
        result = await client.push_bytes(req, peer, data, chunk=65536)
    assert result.checksum == checksum.of_buffer(data)
    async with await ReceiverClient.connect(local.receiver_socket) as consumer:
        await consumer.release(req)


async def _closed_without_a_word(reader: asyncio.StreamReader) -> bool:
    """The daemon hung up; whatever it sent was not a lease or a key."""
    try:
        data = await asyncio.wait_for(reader.read(), 10)
    except (ssl.SSLError, ConnectionError):
        return True
    return b"lease" not in data and b"ready" not in data


async def _answer(reader: asyncio.StreamReader) -> RawMessage:
    decoder = FrameDecoder(CONTROL)
    while (msg := decoder.next_message()) is None:
        data = await asyncio.wait_for(reader.read(65536), 10)
        assert data, "closed without an answer"
        decoder.feed(data)
    return msg.to_wire()  # as the adversary sees it: the frame's map


async def _hello_as(local: LocalDaemons, credentials: Trust, name: str,
                    role: str = "sender") -> RawMessage:
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", local.receiver.control_port, ssl=credentials.client)
    writer.write(encode(message("hello", role=role, name=name, transports=["tcp"])))
    msg = await _answer(reader)
    writer.close()
    return msg


async def test_a_plaintext_sender_is_told_tls_is_required_and_gets_nothing_else(
        local: LocalDaemons) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", local.receiver.control_port)
    writer.write(encode(message("hello", role="sender", name="prefill", transports=["tcp"])))
    answer = await _answer(reader)
    assert answer["t"] == "error" and answer["error"]["code"] == "auth_failed"
    assert "takes mutual TLS" in answer["error"]["message"]
    assert await _closed_without_a_word(reader)
    writer.close()
    await until(lambda: _refusals(local, "not_tls") == 1, what="the refusal counted")
    await _push_ok(local, "after-plaintext")


async def test_a_sender_without_tls_hears_why_from_a_tls_receiver(tmp_path: Path) -> None:
    """It used to hear PeerLost, "closed the control connection", with a
    network hint; the cause was only in the receiver's log."""
    local = await start_local(tmp_path, sender={"auth": "none"})
    try:
        async with await SenderClient.connect(local.sender_socket) as client:
            with pytest.raises(AuthenticationFailed, match="takes mutual TLS") as info:
                await client.push_bytes("r", "decode", b"x" * 4096)
        assert "kvctl keys" in info.value.hint
        assert local.receiver.pool.used_bytes == 0
    finally:
        await local.sender.stop()
        await local.receiver.stop()


async def test_a_port_that_never_answers_tls_is_named_as_such(local: LocalDaemons) -> None:
    """A tarpit: it takes the connection and says nothing. The error used to
    end in "cannot reach receiver ...:" with an empty cause."""
    held: list[asyncio.StreamWriter] = []

    async def tarpit(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(tarpit, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    local.sender.reload_peers({"decode": f"127.0.0.1:{local.receiver.control_port}",
                               "tarpit": f"127.0.0.1:{port}"})
    try:
        async with await SenderClient.connect(local.sender_socket) as client:
            with pytest.raises(PeerLost, match=r"took the connection but completed no TLS "
                                               r"handshake within 2 s") as info:
                await client.push_bytes("r", "tarpit", b"x" * 4096)
        assert 'auth = "tls"' in info.value.hint
    finally:
        for writer in held:
            writer.close()
        server.close()
    await _push_ok(local, "after-tarpit")


async def test_an_engine_on_the_control_port_is_told_where_engines_go(
        local: LocalDaemons) -> None:
    answer = await _hello_as(local, local.credentials("prefill"), "prefill", role="decode")
    assert answer["t"] == "error" and answer["error"]["code"] == "protocol"
    assert "'decode' connected to receiver decode's control port" in answer["error"]["message"]
    assert "unix socket" in answer["error"]["hint"]


async def test_a_certificate_of_another_cluster_is_refused(local: LocalDaemons,
                                                           tmp_path: Path) -> None:
    stranger = local_cluster(tmp_path / "other-cluster", {"prefill": "sender"})
    credentials = Trust(str(stranger["prefill"]), "prefill")
    credentials.client.verify_mode = ssl.CERT_NONE  # an attacker trusts anything
    with pytest.raises((ssl.SSLError, ConnectionError, AssertionError)):
        # TLS 1.3: the refusal of a client certificate comes after the
        # client's side of the handshake, on the first read.
        await _hello_as(local, credentials, "prefill")
    await until(lambda: _refusals(local, "bad_certificate") == 1, what="the refusal counted")
    await _push_ok(local, "after-stranger")


async def test_a_sender_cannot_claim_another_senders_name(local: LocalDaemons) -> None:
    answer = await _hello_as(local, local.credentials("rogue"), "prefill")
    assert answer["t"] == "error"
    assert answer["error"]["code"] == "auth_failed"
    assert "'rogue'" in answer["error"]["message"]
    assert _refusals(local, "wrong_name") == 1
    await _push_ok(local, "after-impostor")


async def test_a_receivers_certificate_cannot_act_as_a_sender(local: LocalDaemons) -> None:
    with pytest.raises((ssl.SSLError, ConnectionError, AssertionError)):
        await _hello_as(local, local.credentials("decode-2", "receiver"), "decode-2")
    await until(lambda: _refusals(local, "bad_certificate") == 1, what="the refusal counted")


async def test_only_listed_senders_are_accepted(tmp_path: Path) -> None:
    local = await start_local(tmp_path, receiver={"senders": ["prefill"]})
    try:
        answer = await _hello_as(local, local.credentials("other-prefill"), "other-prefill")
        assert answer["t"] == "error" and answer["error"]["code"] == "access_denied"
        assert "senders" in answer["error"]["hint"]
        assert _refusals(local, "not_allowed") == 1
        await _push_ok(local, "listed")
    finally:
        await local.sender.stop()
        await local.receiver.stop()


async def test_a_sender_will_not_push_to_a_receiver_of_another_cluster(tmp_path: Path) -> None:
    stranger = local_cluster(tmp_path / "other-cluster", {"prefill": "sender"})
    local = await start_local(tmp_path, sender={"tls_dir": str(stranger["prefill"])})
    try:
        async with await SenderClient.connect(local.sender_socket) as client:
            with pytest.raises(AuthenticationFailed, match="TLS handshake") as info:
                await client.push_bytes("r", "decode", b"x" * 4096)
        assert "cluster" in info.value.hint
        assert local.receiver.pool.used_bytes == 0
    finally:
        await local.sender.stop()
        await local.receiver.stop()


async def test_a_sender_will_not_push_to_a_receiver_under_another_name(
        local: LocalDaemons) -> None:
    # "decode-x" is configured at decode's address: a mis-wired peer list.
    local.sender.reload_peers({"decode": f"127.0.0.1:{local.receiver.control_port}",
                               "decode-x": f"127.0.0.1:{local.receiver.control_port}"})
    async with await SenderClient.connect(local.sender_socket) as client:
        with pytest.raises(AuthenticationFailed, match=r"'decode'.*not 'decode-x'"):
            await client.push_bytes("r", "decode-x", b"x" * 4096)
    await _push_ok(local, "right-name")


async def test_connections_that_never_authenticate_are_cut_off_and_counted(
        tmp_path: Path) -> None:
    local = await start_local(tmp_path, receiver={"handshake_timeout": 0.5})
    try:
        idle = [await asyncio.open_connection("127.0.0.1", local.receiver.control_port)
                for _ in range(20)]
        idle[0][1].write(b"\x16")  # slowloris: one byte of a TLS record, then nothing
        for reader, writer in idle:
            assert await asyncio.wait_for(reader.read(), 10) == b""
            writer.close()
        await until(lambda: _refusals(local, "timeout") == 20, what="20 timeouts counted")
        await _push_ok(local, "after-idlers")
    finally:
        await local.sender.stop()
        await local.receiver.stop()


async def test_at_most_a_bounded_number_authenticate_at_once(local: LocalDaemons) -> None:
    limit = local.receiver._gate.limit
    idle = [await asyncio.open_connection("127.0.0.1", local.receiver.control_port)
            for _ in range(limit + 10)]
    await until(lambda: _refusals(local, "too_many") == 10, what="the excess refused at once")
    assert local.receiver._gate.pending == limit
    for _, writer in idle:
        writer.close()
    await until(lambda: local.receiver._gate.pending == 0, what="the door emptied")


async def test_rotation_by_reload_keeps_established_sessions(local: LocalDaemons) -> None:
    await _push_ok(local, "before-rotation")
    sessions = set(local.receiver.sessions)
    tls = local.tls_root
    issue(tls / "ca", "prefill", "sender", tls / "prefill")  # a new key and certificate
    assert local.sender.trust is not None and local.sender.trust.reload()
    await _push_ok(local, "after-rotation")
    assert local.receiver.sessions == sessions  # the session was not dropped
    # New handshakes present the new certificate, and it is accepted.
    answer = await _hello_as(local, Trust(str(tls / "prefill"), "prefill"), "prefill")
    assert answer["t"] == "welcome"

    (tls / "prefill" / "node.key").write_text("not a key")
    os.chmod(tls / "prefill" / "node.key", 0o600)
    assert not local.sender.trust.reload()  # refused; the loaded credentials stay
    await _push_ok(local, "after-a-bad-rotation")


async def test_running_without_authentication_is_explicit_and_logged(tmp_path: Path) -> None:
    with structlog.testing.capture_logs() as logs:
        local = await start_local(tmp_path, receiver={"auth": "none"},
                                  sender={"auth": "none"})
    try:
        assert [entry["role"] for entry in logs
                if entry["event"] == "authentication is off"] == ["receiver", "sender"]
        await _push_ok(local, "unauthenticated")
    finally:
        await local.sender.stop()
        await local.receiver.stop()


async def test_a_sender_over_its_quota_waits_then_gets_pool_full_alone(tmp_path: Path) -> None:
    local = await start_local(tmp_path, receiver={"sender_quota": "25%", "lease_wait": 0.3})
    try:
        # A greedy sender holds its whole quota (16 MiB of 64), as delivered
        # requests nobody releases.
        async with await SenderClient.connect(local.sender_socket) as client:
            for n in range(2):
                await client.push_bytes(f"greedy-{n}", "decode", b"g" * (8 << 20))
            with pytest.raises(PoolFull, match="quota") as info:
                await client.push_bytes("greedy-over", "decode", b"g" * (1 << 20))
        assert "sender_quota" in info.value.hint
        # Another sender of the cluster is not held up by it.
        tls = local_cluster(local.tls_root, {"prefill-b": "sender"})
        second = build_daemon(build(SenderConfig, {
            "name": "prefill-b", "socket": str(tmp_path / "b.sock"), "metrics": "127.0.0.1:0",
            "staging_size": "16MiB", "tls_dir": str(tls["prefill-b"]),
            "peers": {"decode": f"127.0.0.1:{local.receiver.control_port}"}}))
        await second.start()
        try:
            async with await SenderClient.connect(str(tmp_path / "b.sock")) as client:
                await client.push_bytes("polite", "decode", b"p" * (8 << 20))
        finally:
            await second.stop()
        assert local.receiver.quotas.held == {"prefill": 16 << 20, "prefill-b": 8 << 20}
        async with await ReceiverClient.connect(local.receiver_socket) as consumer:
            await consumer.release("polite")
        async with await ReceiverClient.connect(local.receiver_socket) as consumer:
            for n in range(2):
                await consumer.release(f"greedy-{n}")
        assert local.receiver.quotas.held == {}
        await _push_ok(local, "after-release")
    finally:
        await local.sender.stop()
        await local.receiver.stop()


async def test_a_sender_dropped_from_senders_is_cut_off_on_reload(local: LocalDaemons) -> None:
    await _push_ok(local, "while-listed")
    local.receiver.reload(dataclasses.replace(local.receiver.config, senders=["prefill-b"]))
    await until(lambda: not local.receiver.sessions, what="the session dropped")
    async with await SenderClient.connect(local.sender_socket) as client:
        with pytest.raises(AccessDenied, match="does not accept sender 'prefill'"):
            await client.push_bytes("unlisted", "decode", b"x" * 4096)
    assert local.receiver.pool.used_bytes == 0


def _peer_labels(registry: Any) -> set[str]:
    page = generate_latest(registry).decode()
    return {line.split('peer="', 1)[1].split('"', 1)[0]
            for line in page.splitlines() if 'peer="' in line}


async def test_made_up_names_cannot_grow_the_metrics_page(tmp_path: Path) -> None:
    local = await start_local(tmp_path, receiver={"auth": "none"}, sender={"auth": "none"})
    try:
        for n in range(MAX_PEER_LABELS + 20):
            reader, writer = await asyncio.open_connection("127.0.0.1",
                                                           local.receiver.control_port)
            writer.write(encode(message("hello", role="sender", name=f"made-up-{n}",
                                        transports=["tcp"])))
            writer.write(encode(message("connect", params={})))
            decoder = FrameDecoder(CONTROL)
            while (msg := decoder.next_message()) is None or msg.kind != "ready":
                data = await asyncio.wait_for(reader.read(65536), 10)
                assert data
                decoder.feed(data)
            writer.close()
        labels = _peer_labels(local.receiver.metrics.registry)
        assert len(labels) <= MAX_PEER_LABELS + 1 and "other" in labels
    finally:
        await local.sender.stop()
        await local.receiver.stop()


async def test_a_removed_peers_series_go_away(local: LocalDaemons) -> None:
    address = f"127.0.0.1:{local.receiver.control_port}"
    await _push_ok(local, "counted")
    assert "decode" in _peer_labels(local.sender.metrics.registry)
    local.sender.reload_peers({})
    await until(lambda: "decode" not in _peer_labels(local.sender.metrics.registry),
                what="the removed peer's series gone")
    local.sender.reload_peers({"decode": address})
    await _push_ok(local, "back")


def _reissue_with_window(tls: Path, name: str, before_days: float, after_days: float) -> None:
    """Overwrite ``name``'s certificate with one valid from ``before_days`` to
    ``after_days`` from now (negative: in the past), signed by the cluster CA."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization

    from kvctl.keys import ROLES, _load_ca, _name

    ca_certificate, ca_key = _load_ca(tls / "ca")
    node = tls / name
    key = serialization.load_pem_private_key((node / "node.key").read_bytes(), None)
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder().subject_name(_name(name))
        .issuer_name(ca_certificate.subject).public_key(key.public_key())  # type: ignore[arg-type]
        .serial_number(x509.random_serial_number())
        .not_valid_before(now + datetime.timedelta(days=before_days))
        .not_valid_after(now + datetime.timedelta(days=after_days))
        .add_extension(x509.ExtendedKeyUsage(ROLES["receiver"]), critical=True)
        .sign(ca_key, hashes.SHA256()))
    (node / "node.crt").write_bytes(certificate.public_bytes(serialization.Encoding.PEM))


def test_an_expired_certificate_is_refused_at_start_and_at_reload_keeping_the_old(
        tmp_path: Path) -> None:
    tls = tmp_path / "tls"
    directory = local_cluster(tls, {"decode": "receiver"})["decode"]
    trust = Trust(str(directory), "decode")
    good_until = trust.expires_at
    _reissue_with_window(tls, "decode", -3, -1)
    assert trust.reload() is False  # the loaded credentials stay in force
    assert trust.expires_at == good_until
    with pytest.raises(ConfigError, match="expired at") as refused:
        Trust(str(directory), "decode")
    assert "kvctl keys issue" in refused.value.hint
    _reissue_with_window(tls, "decode", 2, 30)
    with pytest.raises(ConfigError, match="not valid before"):
        Trust(str(directory), "decode")


def test_a_certificate_close_to_expiry_loads_with_a_warning(tmp_path: Path) -> None:
    tls = tmp_path / "tls"
    directory = local_cluster(tls, {"decode": "receiver"})["decode"]
    _reissue_with_window(tls, "decode", -1, 3)
    with structlog.testing.capture_logs() as logs:
        trust = Trust(str(directory), "decode")
    assert trust.expires_at > 0
    warned = [entry for entry in logs if entry["log_level"] == "warning"]
    assert warned and warned[0]["days_left"] < 14


@pytest.mark.parametrize("days", [0, -5])
def test_keys_issue_refuses_a_lifetime_that_is_already_over(tmp_path: Path, days: int) -> None:
    local_cluster(tmp_path / "tls", {"decode": "receiver"})
    with pytest.raises(ConfigError, match="already expired"):
        issue(tmp_path / "tls" / "ca", "prefill", "sender", tmp_path / "out", days=days)


async def test_an_authenticated_link_is_kept_when_its_receiver_is_given_another_address(
        local: LocalDaemons) -> None:
    """The receiver proved its name by certificate and is still there: a new
    address (config or registry) is where the link reconnects, not a reason
    to drop it and every push on it."""
    await _push_ok(local, "before")
    link = local.sender.links["decode"]
    assert link.connected
    local.sender.reload_peers({"decode": "127.0.0.1:9"})  # nothing listens there
    assert local.sender.links["decode"] is link and link.connected
    assert link.address == "127.0.0.1:9"
    await _push_ok(local, "on-the-kept-link")
