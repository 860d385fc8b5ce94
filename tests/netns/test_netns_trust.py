"""The receiver's ports, tried from another host as an adversary would: idle
connections by the hundred on the control and data ports, and a plaintext
peer. Each is closed within the handshake timeout, counted by reason, and
costs the receiver a bounded amount of memory; an authenticated push still
works afterwards. (The per-attack checks of authentication and per-lease
keys run in-process in test_trust.py and test_lease_keys.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvctl.netns import DaemonProcess, NetnsPair, check_can_run, scrape_in, two_hosts
from kvctl.processes import holdings

_why_not = check_can_run()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(_why_not is not None, reason=_why_not or "")]

IDLE = 500  # per port
HANDSHAKE_TIMEOUT = 3.0
# 500 idle connections per port are let in 64 at a time with a 16-byte
# buffer each; the rest are closed at once. What they may cost, all told.
RSS_BOUND = 16 << 20

# Opens the connections, says so, waits for the go, then times until the
# receiver has closed every one of them.
IDLER = """
import json, socket, sys, time
host, ports, count = sys.argv[1], [int(p) for p in sys.argv[2].split(",")], int(sys.argv[3])
conns = [socket.create_connection((host, port)) for port in ports for _ in range(count)]
print("open", flush=True)
sys.stdin.readline()
started = time.monotonic()
for conn in conns:
    conn.settimeout(60)
    try:
        while conn.recv(4096):
            pass
    except OSError:
        pass  # reset: closed too
print(json.dumps({"all_closed_after": time.monotonic() - started}), flush=True)
"""


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[tuple[NetnsPair, DaemonProcess, DaemonProcess]]:
    with two_hosts(tmp_path, receiver={"handshake_timeout": HANDSHAKE_TIMEOUT},
                   tag=f"t{uuid.uuid4().hex[:6]}") as running:
        yield running


def test_hundreds_of_idle_connections_are_bounded_cut_off_and_counted(
        hosts: tuple[NetnsPair, DaemonProcess, DaemonProcess]) -> None:
    pair, rx, tx = hosts
    assert rx.process is not None
    pid = rx.process.pid
    before = holdings(pid).rss_bytes
    idler = subprocess.Popen(
        pair.argv(pair.prefill, [sys.executable, "-c", IDLER, pair.decode.address,
                                 "7471,7472", str(IDLE)]),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert idler.stdout is not None and idler.stdin is not None
        assert idler.stdout.readline().strip() == "open"
        during = holdings(pid).rss_bytes
        idler.stdin.write("go\n")
        idler.stdin.flush()
        result = json.loads(idler.stdout.readline())
    finally:
        idler.kill()
        idler.wait()
    grown = during - before
    print(f"receiver RSS {before >> 20} MiB before, {during >> 20} MiB with {2 * IDLE} idle "
          f"connections (+{grown / (1 << 20):.1f} MiB); all closed "
          f"{result['all_closed_after']:.1f} s after")
    assert grown < RSS_BOUND
    assert result["all_closed_after"] < HANDSHAKE_TIMEOUT + 10

    deadline = time.monotonic() + 30
    while True:
        status = scrape_in(pair, pair.decode, 9471)
        counted = {channel: {reason: status.total("kvwire_auth_failures_total",
                                                  channel=channel, reason=reason)
                             for reason in ("timeout", "too_many", "incomplete")}
                   for channel in ("control", "data")}
        if all(sum(reasons.values()) == IDLE for reasons in counted.values()):
            break
        assert time.monotonic() < deadline, counted
        time.sleep(0.2)
    print(f"refusals: {counted}")
    for reasons in counted.values():
        # The door held at most 64 at a time; the rest were closed at once.
        assert reasons["too_many"] > 0 and reasons["timeout"] >= 64

    # The daemons still serve.
    push = subprocess.run(
        pair.argv(pair.prefill, [sys.executable, "-m", "kvctl", "push", "--socket",
                                 tx.socket, "--peer", "decode", "--layers", "2",
                                 "--tokens", "64", "--json"]),
        capture_output=True, text=True, timeout=60)
    assert push.returncode == 0, push.stderr
