"""kvwire between the two lab nodes over real rdma_rxe (verbs) and over TCP.

The daemons run in the nodes from their config files; the prefill engine is
`kvctl push` on the prefill node, the decode engine `kvctl consume` on the
decode node, which checks every byte against the same seeded cache.
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from kvctl.lab.daemons import DECODE_ADDRESS, NodeDaemon, receiver_config, sender_config
from kvctl.lab.machine import SHARED_DIR, LabState, run_in
from kvwired.layout import KVLayout

from ..waiting import wait_until

pytestmark = pytest.mark.lab

# An error that must come "not as a hang" comes within this; generous, as the
# nodes are emulated (a wrong GID index took 33.8 s to be refused in one run).
HANG_GUARD = 90.0
# A cache of this many tokens (12 MiB) wherever a test checks what kvwire
# does rather than how it does at the full 48 MiB: on the emulated nodes the
# full cache cost a push 3.5 s to make up, 4 to 20 s to move, and as much to
# check, and the tests that are about 48 MiB (and the rail cut's long push)
# still push all of it.
SMALL_TOKENS = 1024
SMALL_BYTES = KVLayout(tokens=SMALL_TOKENS).total_bytes
# What a dead rail's probe may send while a push runs on the other rail: its
# zero-length write, resent every ACK timeout (268 ms in the lab) for up to
# connect_timeout (20 s): about 75 packets (1,200 at 17 ms). Half of a 12 MiB
# push over that rail would be 6,000 or more.
PROBE_PACKETS = 2000


@dataclass
class Daemons:
    transport: str
    receiver: NodeDaemon
    sender: NodeDaemon
    state: LabState


@pytest.fixture(scope="module", params=["verbs", "tcp"])
def daemons(lab: LabState, request: pytest.FixtureRequest) -> Iterator[Daemons]:
    transport = request.param
    # Listening on every address: a sender reaches it over either rail, and
    # the data path follows the control connection's.
    receiver = NodeDaemon("decode", "receiver",
                          receiver_config(transport=transport, pool_size="256MiB",
                                          listen="0.0.0.0:7471"), lab)
    sender = NodeDaemon("prefill", "sender",
                        sender_config(transport=transport, staging_size="256MiB"), lab)
    receiver.start()
    sender.start()
    yield Daemons(transport, receiver, sender, lab)
    assert sender.stop() == 0, sender.log_tail()
    assert receiver.stop() == 0, receiver.log_tail()


class Background(threading.Thread):
    """A command in a node, run while the test does something else."""

    def __init__(self, node: str, argv: list[str], state: LabState) -> None:
        super().__init__(daemon=True)
        self.node, self.argv, self.state = node, argv, state
        self.result: tuple[int, str, str] | None = None
        self.start()

    def run(self) -> None:
        self.result = run_in(self.node, self.argv, state=self.state)

    def outcome(self, timeout: float = 300) -> tuple[int, str, str]:
        self.join(timeout)
        assert self.result is not None, f"{self.argv} still running after {timeout} s"
        return self.result


def kvctl_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvctl", *args]


def consume(d: Daemons, requests: list[str], seed: int, socket: str | None = None,
            timeout: float = 240, tokens: int = KVLayout().tokens) -> Background:
    return Background("decode", kvctl_argv(
        "consume", *requests, "--socket", socket or d.receiver.socket, "--expect-seed",
        str(seed), "--tokens", str(tokens), "--timeout", str(timeout), "--json"), d.state)


def push_argv(socket: str, req: str, seed: int, *extra: str, peer: str = "decode",
              tokens: int = KVLayout().tokens) -> list[str]:
    """`kvctl push` of the seeded synthetic cache, as the prefill engine."""
    return kvctl_argv("push", "--socket", socket, "--peer", peer, "--req", req,
                      "--seed", str(seed), "--tokens", str(tokens), *extra)


def push(d: Daemons, req: str, seed: int, *extra: str, socket: str | None = None,
         peer: str = "decode", tokens: int = KVLayout().tokens,
         ) -> tuple[int, list[dict[str, Any]], str]:
    code, out, err = run_in("prefill", push_argv(
        socket or d.sender.socket, req, seed, "--json", *extra, peer=peer, tokens=tokens),
        state=d.state)
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return code, records, err


def records_of(background: Background) -> list[dict[str, Any]]:
    code, out, err = background.outcome()
    assert code == 0, out + err
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("granularity",
                         ["per-token-per-layer", "per-token", "per-layer", "whole"])
def test_48mib_cache_arrives_byte_exact(daemons: Daemons, granularity: str) -> None:
    req = f"{daemons.transport}-{granularity}"
    decode = consume(daemons, [req], seed=7)
    code, pushed, err = push(daemons, req, 7, "--chunk", granularity)
    assert code == 0, err
    (received,) = records_of(decode)
    assert received["bytes"] == 48 << 20 and received["layers"] == 24
    assert received["checksum_ok"] and received["bytes_ok"]
    (record,) = pushed
    print(f"{daemons.transport} {granularity}: {record['gbps']:.3f} Gb/s, "
          f"{record['writes']} writes, {record['seconds'] * 1e3:.0f} ms")


def test_concurrent_requests(daemons: Daemons) -> None:
    requests = [f"{daemons.transport}-concurrent-{n}" for n in range(4)]
    decode = consume(daemons, requests, seed=11, tokens=SMALL_TOKENS)
    code, pushed, err = push(daemons, f"{daemons.transport}-concurrent", 11, "--count", "4",
                             "--concurrency", "4", "--chunk", "per-token", tokens=SMALL_TOKENS)
    assert code == 0, err
    assert len(pushed) == 4
    received = records_of(decode)
    assert sorted(r["req"] for r in received) == requests
    assert all(r["checksum_ok"] and r["bytes_ok"] for r in received)


def _writes_sent(d: Daemons) -> float:
    port = d.state.nodes["prefill"].ports["metrics_sender"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("kvwire_data_writes_total{"))


def test_receiver_killed_mid_transfer_fails_fast_then_recovers(daemons: Daemons) -> None:
    before = _writes_sent(daemons)
    pushing = Background("prefill", kvctl_argv(
        "push", "--socket", daemons.sender.socket, "--peer", "decode", "--req",
        f"{daemons.transport}-doomed", "--count", "3", "--chunk", "per-token-per-layer"),
        daemons.state)
    deadline = time.monotonic() + 120
    while _writes_sent(daemons) < before + 20000:  # well into the transfer
        assert time.monotonic() < deadline, "the push never got going"
        assert pushing.is_alive(), pushing.result
        time.sleep(0.2)
    daemons.receiver.signal("KILL")
    killed_at = time.monotonic()
    code, out, err = pushing.outcome(60)
    failed_after = time.monotonic() - killed_at
    assert code == 2, out + err
    assert "receiver decode" in err, err
    assert failed_after < 10, f"the push failed {failed_after:.1f} s after the kill"
    print(f"{daemons.transport}: push failed {failed_after:.2f} s after the receiver was "
          f"killed: {err.strip().splitlines()[0]}")

    daemons.receiver.start()  # restarted, as systemd would
    decode = consume(daemons, [f"{daemons.transport}-after-restart"], seed=3,
                     tokens=SMALL_TOKENS)
    code, _, err = push(daemons, f"{daemons.transport}-after-restart", 3, "--chunk", "per-layer",
                        tokens=SMALL_TOKENS)
    assert code == 0, err
    (received,) = records_of(decode)
    assert received["bytes_ok"]
    assert daemons.sender.running


def test_two_senders_into_one_receiver(daemons: Daemons) -> None:
    second = NodeDaemon("prefill", "sender",
                        sender_config(f"prefill-b-{daemons.transport}",
                                      transport=daemons.transport, metrics="0.0.0.0:0",
                                      staging_size="64MiB"), daemons.state).start()
    try:
        requests = [f"{daemons.transport}-from-a", f"{daemons.transport}-from-b"]
        decode = consume(daemons, requests, seed=5, tokens=SMALL_TOKENS)
        a = Background("prefill", push_argv(daemons.sender.socket, requests[0], 5,
                                            tokens=SMALL_TOKENS), daemons.state)
        b = Background("prefill", push_argv(second.socket, requests[1], 5,
                                            tokens=SMALL_TOKENS), daemons.state)
        for pushing in (a, b):
            code, out, err = pushing.outcome()
            assert code == 0, out + err
        assert all(r["bytes_ok"] for r in records_of(decode))
    finally:
        second.stop()


def test_one_sender_into_two_receivers(daemons: Daemons) -> None:
    port = 7481
    second = NodeDaemon("decode", "receiver", receiver_config(
        f"decode-b-{daemons.transport}", transport=daemons.transport,
        listen=f"{DECODE_ADDRESS}:{port}", data_port=port + 1, metrics="0.0.0.0:0",
        pool_size="64MiB"), daemons.state).start()
    # Peers are named as their receivers' certificates name them.
    second_name = f"decode-b-{daemons.transport}"
    multi = NodeDaemon("prefill", "sender", sender_config(
        f"prefill-multi-{daemons.transport}", transport=daemons.transport,
        metrics="0.0.0.0:0", staging_size="64MiB",
        peers={"decode": f"{DECODE_ADDRESS}:7471", second_name: f"{DECODE_ADDRESS}:{port}"}),
        daemons.state).start()
    try:
        to_a = consume(daemons, [f"{daemons.transport}-to-a"], seed=9, tokens=SMALL_TOKENS)
        to_b = consume(daemons, [f"{daemons.transport}-to-b"], seed=9, socket=second.socket,
                       tokens=SMALL_TOKENS)
        for req, peer in ((f"{daemons.transport}-to-a", "decode"),
                          (f"{daemons.transport}-to-b", second_name)):
            code, _, err = push(daemons, req, 9, socket=multi.socket, peer=peer,
                                tokens=SMALL_TOKENS)
            assert code == 0, err
        assert records_of(to_a)[0]["bytes_ok"] and records_of(to_b)[0]["bytes_ok"]
    finally:
        multi.stop()
        second.stop()


def _wire_counters(d: Daemons) -> dict[str, int]:
    """The prefill node's bytes sent per wire, and packets sent per rxe device."""
    code, out, err = run_in("prefill", ["sh", "-c", """
for rail in 0 1; do
    echo wire$rail $(cat /sys/class/net/wire$rail/statistics/tx_bytes)
    echo rxe$rail $(cat /sys/class/infiniband/rxe$rail/ports/1/hw_counters/sent_pkts)
done"""], state=d.state)
    assert code == 0, err
    return {name: int(value) for name, value in (line.split() for line in out.splitlines())}


def test_a_peer_on_the_second_rail_is_served_over_that_rail_only(daemons: Daemons) -> None:
    # The lab has two rails; a peer named by its rail-1 address: control and
    # data both go over wire1 (and over verbs, rxe1), byte-exact, and the
    # pool both daemons registered with each device serves either.
    decode_rail1 = daemons.state.nodes["decode"].rail_addresses[1]
    railed = NodeDaemon("prefill", "sender", sender_config(
        f"prefill-rail1-{daemons.transport}", transport=daemons.transport, metrics="0.0.0.0:0",
        staging_size="64MiB", peers={"decode": f"{decode_rail1}:7471"}),
        daemons.state).start()
    try:
        req = f"{daemons.transport}-rail1"
        decode = consume(daemons, [req], seed=13, tokens=SMALL_TOKENS)
        before = _wire_counters(daemons)
        code, _, err = push(daemons, req, 13, "--chunk", "per-layer", socket=railed.socket,
                            tokens=SMALL_TOKENS)
        after = _wire_counters(daemons)
        assert code == 0, err
        (received,) = records_of(decode)
        assert received["bytes_ok"] and received["checksum_ok"]
        sent = {name: after[name] - before[name] for name in after}
        assert sent["wire1"] >= SMALL_BYTES, sent
        assert sent["wire0"] < 1 << 20, sent  # the agent is on mgmt0; nothing else uses wire0
        if daemons.transport == "verbs":
            assert sent["rxe1"] >= SMALL_BYTES // 1024, sent  # 1 KiB MTU: a packet per KiB
            assert sent["rxe0"] < 1000, sent
        print(f"{daemons.transport} over rail 1: {sent}")
    finally:
        railed.stop()


def test_four_channels_per_peer_every_granularity_byte_exact(daemons: Daemons) -> None:
    # qps_per_peer = 4: four RC queue pairs (TCP: four streams) to the
    # receiver; every layer is announced only once all four placed their part.
    # Over verbs the four are spread over the lab's two rails, rxe0 and rxe1.
    rails: dict[str, Any] = {"rails": ["rxe0", "rxe1"]} if daemons.transport == "verbs" else {}
    striped = NodeDaemon("prefill", "sender", sender_config(
        f"prefill-qp4-{daemons.transport}", transport=daemons.transport, metrics="0.0.0.0:0",
        staging_size="64MiB", qps_per_peer=4, **rails), daemons.state).start()
    try:
        before = _wire_counters(daemons)
        for granularity in ("per-token-per-layer", "per-token", "per-layer", "whole"):
            req = f"{daemons.transport}-qp4-{granularity}"
            decode = consume(daemons, [req], seed=17, tokens=SMALL_TOKENS)
            code, pushed, err = push(daemons, req, 17, "--chunk", granularity,
                                     socket=striped.socket, tokens=SMALL_TOKENS)
            assert code == 0, err
            (received,) = records_of(decode)
            assert received["bytes_ok"] and received["checksum_ok"], received
            (record,) = pushed
            print(f"{daemons.transport} 4 channels {granularity}: {record['gbps']:.3f} Gb/s, "
                  f"{record['seconds'] * 1e3:.0f} ms")
        sent = {name: value - before[name] for name, value in _wire_counters(daemons).items()}
        print(f"{daemons.transport} 4 channels, sent per wire and device: {sent}")
        log = striped.log_text()
        assert '"channels": 4' in log, log[-2000:]
        if rails:
            # Two channels a rail: each wire carried a share of the 4 x 12 MiB.
            assert '"rails": ["rxe0", "rxe1"]' in log, log[-2000:]
            for rail in ("rxe0", "rxe1"):
                assert sent[rail] >= SMALL_BYTES // 1024, sent  # 1 KiB MTU: a packet per KiB
            for wire in ("wire0", "wire1"):
                assert sent[wire] >= SMALL_BYTES, sent
    finally:
        striped.stop()


def _netem(d: Daemons, wire: str, rule: str | None) -> None:
    argv = (["tc", "qdisc", "replace", "dev", wire, "root", "netem", *rule.split()] if rule
            else ["tc", "qdisc", "del", "dev", wire, "root"])
    code, _, err = run_in("prefill", argv, state=d.state)
    assert code == 0 or rule is None, err


def _wait_for_log(daemon: NodeDaemon, pattern: str, since: int, timeout: float) -> float:
    """Seconds until ``pattern`` shows in the daemon's log after its first ``since`` chars."""
    try:
        return wait_until(lambda: pattern in daemon.log_text()[since:], timeout,
                          f"{pattern!r} in the log", every=0.2)
    except AssertionError as exc:
        raise AssertionError(f"{exc}:\n{daemon.log_text()[-3000:]}") from None


@pytest.mark.parametrize("daemons", ["verbs"], indirect=True)
def test_a_rail_dropped_mid_push_moves_its_channels_to_the_other_and_it_comes_back(
        daemons: Daemons) -> None:
    striped = NodeDaemon("prefill", "sender", sender_config(
        "prefill-rails", transport="verbs", metrics="0.0.0.0:0", staging_size="64MiB",
        qps_per_peer=4, rails=["rxe0", "rxe1"]), daemons.state).start()
    try:
        # A long push (98,304 writes), cut on rail 1 once it is moving there.
        decode = consume(daemons, ["rails-cut"], seed=19)
        pushing = Background("prefill", kvctl_argv(
            "push", "--socket", striped.socket, "--peer", "decode", "--req", "rails-cut",
            "--seed", "19", "--chunk", "per-token-per-layer", "--json"), daemons.state)
        before = _wire_counters(daemons)["wire1"]
        deadline = time.monotonic() + HANG_GUARD
        while _wire_counters(daemons)["wire1"] - before < 2 << 20:
            assert time.monotonic() < deadline and pushing.is_alive(), "rail 1 never carried"
            time.sleep(0.2)
        log_mark = len(striped.log_text())
        _netem(daemons, "wire1", "loss 100%")
        cut = time.monotonic()
        code, _, err = pushing.outcome(HANG_GUARD)
        delivered_after = time.monotonic() - cut
        # Rail 1's channels placed nothing for the stall bound: each is
        # replaced on rail 0 and its lost writes posted again there, under
        # the same control connection, and the push is delivered byte for
        # byte. No replacement goes back to the dead rail: one once did, its
        # task started after a slow sibling's offer had outlasted the rail's
        # 5 s backoff, and the push failed (now the rail is chosen at the
        # failure). A failure that remains must be typed and say so.
        log_lines = striped.log_text()[log_mark:].splitlines()
        moved_lines = [line for line in log_lines if "data channel replaced" in line]
        tried = [line for line in log_lines if "replacing a data channel" in line]
        assert all('"rail": "rxe0"' in line for line in tried), tried
        if code == 0:
            assert records_of(decode)[0]["bytes_ok"]
            assert moved_lines and all('"rail": "rxe0"' in line for line in moved_lines), \
                moved_lines
        else:
            assert code == 2 and "could not be replaced" in err, err
        # The next push runs on rail 0 alone, while rail 1 is still dead
        # (rxe1's packets are a probe's, if its backoff ran out meanwhile).
        moved = _verified_push_counting_wires(daemons, "rails-left", striped.socket)
        assert moved["wire0"] >= SMALL_BYTES and moved["rxe1"] < PROBE_PACKETS, moved
        # Still dead when its backoff runs out: the idle link tries it again,
        # connecting on it fails (the queue pair's INIT->RTR or the probe),
        # and it is left out for longer while rail 0 carries on.
        retry_mark = len(striped.log_text())
        _wait_for_log(striped, '"rail left out"', retry_mark, 120)
        moved = _verified_push_counting_wires(daemons, "rails-still-left", striped.socket)
        assert moved["wire0"] >= SMALL_BYTES and moved["rxe1"] < PROBE_PACKETS, moved
        # Rail 1 back: the idle link is rebuilt with it, its probe passes.
        _netem(daemons, "wire1", None)
        back_after = _wait_for_log(
            striped, '"rails": ["rxe0", "rxe1"]', log_mark, 120)
        moved = _verified_push_counting_wires(daemons, "rails-back", striped.socket)
        for wire in ("wire0", "wire1"):
            assert moved[wire] >= SMALL_BYTES * 5 // 12, moved  # 12 of the 24 layers each
        print(f"rail cut: push {'delivered' if code == 0 else 'failed'} "
              f"{delivered_after:.2f} s after it, "
              f"{len(moved_lines)} channels moved to rail 0; rail 1 back in use "
              f"{back_after:.1f} s after the loss was lifted")
    finally:
        _netem(daemons, "wire1", None)
        striped.stop()


def _verified_push_counting_wires(d: Daemons, req: str, socket: str) -> dict[str, int]:
    """One per-layer push of a small cache, checked byte for byte by its decode
    engine; what each wire and rxe device of the prefill node sent meanwhile."""
    decode = consume(d, [req], seed=19, tokens=SMALL_TOKENS)
    before = _wire_counters(d)
    code, _, err = push(d, req, 19, "--chunk", "per-layer", socket=socket, tokens=SMALL_TOKENS)
    assert code == 0, err
    assert records_of(decode)[0]["bytes_ok"]
    return {name: value - before[name] for name, value in _wire_counters(d).items()}


def test_unreachable_peer_is_a_clear_error_not_a_hang(daemons: Daemons) -> None:
    lost = NodeDaemon("prefill", "sender", sender_config(
        f"prefill-lost-{daemons.transport}", transport=daemons.transport, metrics="0.0.0.0:0",
        connect_timeout=3.0, peers={"nowhere": "198.18.78.99:7471"}), daemons.state).start()
    try:
        started = time.monotonic()
        code, _, err = push(daemons, "lost", 1, socket=lost.socket, peer="nowhere")
        assert code == 2
        assert "cannot reach receiver nowhere" in err, err
        assert time.monotonic() - started < HANG_GUARD
    finally:
        lost.stop()


def test_kvctl_run_chunk_sweep_in_the_lab(daemons: Daemons) -> None:
    out = SHARED_DIR / f"sweep-{daemons.transport}"
    baseline = ["--baseline", "perftest"] if daemons.transport == "verbs" else []
    code, stdout, err = run_in("prefill", kvctl_argv(
        "run", "chunk-sweep", "--socket", daemons.sender.socket, "--sizes", "4KiB,256KiB",
        "--iters", "30", "--latency-bytes", "2MiB", "--stream-bytes", "2MiB", *baseline,
        "--out", str(out)), state=daemons.state)
    assert code == 0, err
    document = json.loads((out / "chunk-sweep.json").read_text())
    assert document["complete"] and document["summary"]["transport"] == daemons.transport
    rows = document["rows"]
    assert [r["size"] for r in rows] == [4096, 256 << 10]
    assert all(r["lat_p50_us"] > 0 and r["stream_gbps"] > 0 and r["deliver_gbps"] > 0
               for r in rows)
    if daemons.transport == "verbs":
        # ib_write_lat / ib_write_bw ran on the same link, and we are quoted against them.
        assert all(r["perftest_gbps"] > 0 and r["perftest_lat_typical_us"] > 0 for r in rows)
        # Pings and ib_write_lat ran a round of each in turn; the ratio is the
        # median of the rounds' own ratios.
        for r in rows:
            assert len(r["perftest_lat_rounds_us"]) == 3
            assert len(r["latency_round_ratios"]) == 3  # none of the runs said 0 µs
            assert r["latency_ratio"] == statistics.median(r["latency_round_ratios"])
            assert r["perftest_lat_typical_us"] == statistics.median(r["perftest_lat_rounds_us"])
            # So did streaming and ib_write_bw, and each ratio carries its spread.
            assert len(r["bandwidth_round_ratios"]) == 3
            assert r["bandwidth_ratio"] == statistics.median(r["bandwidth_round_ratios"])
        assert [r["size"] for r in document["ratios"]] == [4096, 256 << 10]
        for ratio in document["ratios"]:
            for name in ("latency_ratio", "bandwidth_ratio"):
                low, high = ratio[f"{name}_spread"]
                assert low <= ratio[name] <= high
        assert "lat xpt" in stdout
        # The sender's CPU per write, beside ib_write_bw spinning a core on the
        # same writes: one over its write rate, which it reported.
        for r in rows:
            assert r["perftest_cpu_user_us_per_write"] == pytest.approx(
                1e6 / r["perftest_writes_per_s"])
            assert r["cpu_ratio"] == statistics.median(r["cpu_round_ratios"])
            assert not r["stream_cpu_counts_kernel"]  # rdma_rxe's kernel time is the wire's
        assert "CPU xpt" in stdout
    else:
        assert all(r["stream_cpu_counts_kernel"] for r in rows)  # TCP's kernel is its own
    assert "the sender's CPU per streamed write" in stdout and "one core Gb/s" in stdout
    for r in rows:
        assert r["stream_cpu_user_us_per_write"] + r["stream_cpu_system_us_per_write"] > 0
        assert r["lat_cpu_user_us_per_rtt"] >= 0
    for png in ("chunk-sweep-latency.png", "chunk-sweep-bandwidth.png"):
        assert (out / png).stat().st_size > 10_000


def test_kvctl_run_overlap_in_the_lab(daemons: Daemons) -> None:
    out = SHARED_DIR / f"overlap-{daemons.transport}"
    code, stdout, err = run_in("prefill", kvctl_argv(
        "run", "overlap", "--socket", daemons.sender.socket, "--layers", "4",
        "--layer-bytes", "256KiB", "--ratios", "0,1", "--repeats", "1",
        "--out", str(out)), state=daemons.state)
    assert code == 0, err
    document = json.loads((out / "overlap.json").read_text())
    assert document["complete"] and [r["ratio"] for r in document["rows"]] == [0, 1]
    assert document["summary"]["transfer_per_layer_s"] > 0
    assert "ridge point" in stdout
    assert (out / "overlap-speedup.png").stat().st_size > 10_000


@pytest.mark.parametrize("daemons", ["verbs"], indirect=True)
def test_wrong_gid_index_is_a_clear_error_not_a_hang(daemons: Daemons) -> None:
    wrong = NodeDaemon("prefill", "sender", sender_config(
        "prefill-wrong-gid", transport="verbs", metrics="0.0.0.0:0", gid_index=9),
        daemons.state).start()
    try:
        started = time.monotonic()
        code, _, err = push(daemons, "wrong-gid", 1, socket=wrong.socket)
        assert code == 2
        assert "no GID index 9" in err and "populated entries" in err, err
        # A guard against a hang, not a timing: kvctl starts as a new Python
        # process on an emulated CPU (up to 9 s), and the push waits for the
        # sender to connect first (33.8 s in one run).
        assert time.monotonic() - started < HANG_GUARD
    finally:
        wrong.stop()


@pytest.mark.parametrize("daemons", ["verbs"], indirect=True)
def test_memlock_too_low_is_refused_with_the_fix(daemons: Daemons) -> None:
    starved = NodeDaemon("decode", "receiver", receiver_config(
        "decode-starved", transport="verbs", listen=f"{DECODE_ADDRESS}:7491",
        metrics="0.0.0.0:0", pool_size="256MiB"), daemons.state, memlock_kib=8192)
    starved.start(wait=False)
    assert starved.exit_code(60) == 2, starved.log_tail()
    log = starved.log_text()
    # Pinned once per rail's device (the lab has two): 2 x 256 MiB + slack.
    assert "RLIMIT_MEMLOCK) is 8 MiB" in log and "528 MiB" in log, log
    assert "registered with each of rxe0, rxe1" in log, log
    assert "LimitMEMLOCK=infinity" in log and "ulimit -l unlimited" in log


@pytest.mark.parametrize("daemons", ["verbs"], indirect=True)
def test_roce_cut_mid_transfer_fails_the_push_after_the_stall_bound_then_a_new_qp_works(
    daemons: Daemons,
) -> None:
    """RoCE stops getting through mid-transfer, for good: the queue pair retries
    (for ever on rdma_rxe), no write completes, and after the stall bound
    (four heartbeats) with no other rail to move to the link goes down, the
    push fails saying so, and the next push gets a new QP."""
    before = _writes_sent(daemons)
    pushing = Background("prefill", kvctl_argv(
        "push", "--socket", daemons.sender.socket, "--peer", "decode", "--req", "cut-wire",
        "--chunk", "per-token-per-layer"), daemons.state)
    deadline = time.monotonic() + 120
    while _writes_sent(daemons) < before + 20000:
        assert time.monotonic() < deadline, "the push never got going"
        time.sleep(0.2)
    # Drop RoCE v2 (UDP 4791) leaving the prefill node; TCP, so the control
    # connection, still flows. (Taking the decode node's link down instead
    # would stall the prefill node's QEMU on its wire socket.)
    drop_roce = ("tc qdisc add dev wire0 root handle 1: prio && "
                 "tc qdisc add dev wire0 parent 1:3 handle 30: netem loss 100% && "
                 "tc filter add dev wire0 parent 1:0 protocol ip u32 "
                 "match ip dport 4791 0xffff flowid 1:3")
    assert run_in("prefill", ["sh", "-c", drop_roce], state=daemons.state)[0] == 0
    cut_at = time.monotonic()
    try:
        code, out, err = pushing.outcome(60)
        failed_after = time.monotonic() - cut_at
    finally:
        run_in("prefill", ["tc", "qdisc", "del", "dev", "wire0", "root"], state=daemons.state)
    assert code == 2, out + err
    assert "placed nothing for" in err and "writes pending" in err, err
    assert failed_after < HANG_GUARD, f"failed {failed_after:.1f} s after RoCE was cut"
    print(f"RoCE cut: push failed after {failed_after:.2f} s: {err.strip().splitlines()[0]}")
    # The sender dropped the broken connection: the receiver voided the lease.
    deadline = time.monotonic() + 15
    while "sender connection ended" not in daemons.receiver.log_text():
        assert time.monotonic() < deadline, daemons.receiver.log_tail()
        time.sleep(0.5)

    decode = consume(daemons, ["after-cut"], seed=4, tokens=SMALL_TOKENS)
    code, _, err = push(daemons, "after-cut", 4, "--chunk", "per-layer", tokens=SMALL_TOKENS)
    assert code == 0, err
    assert records_of(decode)[0]["bytes_ok"]
