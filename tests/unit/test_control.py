"""The control connection's liveness rule: silence from the peer, not a stall
of our own process, is what declares the peer lost."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time

import pytest

from kvwired.control import MISSED_PINGS, ControlConnection
from kvwired.errors import PeerLost
from kvwired.protocol import encode, message

HEARTBEAT = 0.1

# A daemon's side of a control connection, under uvloop as the daemons run:
# it waits for one message and prints what it got, or why it gave up.
LISTENER = """
import asyncio, json, sys, uvloop
from kvwired.control import ControlConnection
from kvwired.errors import KvwireError

async def main(port):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    connection = ControlConnection(reader, writer, float(sys.argv[2]), "peer")
    print(json.dumps({"waiting": True}), flush=True)
    try:
        got = await connection.recv()
        print(json.dumps({"got": got.kind}), flush=True)
    except KvwireError as exc:
        print(json.dumps({"lost": str(exc)}), flush=True)

uvloop.run(main(int(sys.argv[1])))
"""


def test_what_the_peer_sent_while_this_process_was_stopped_is_read_not_lost() -> None:
    # As when a daemon is SIGSTOPped (or starved) past the peer's silence limit:
    # on SIGCONT the peer's answer is in the socket and the deadline has long
    # passed. The answer wins; only the peer's silence loses the peer.
    with socket.create_server(("127.0.0.1", 0)) as server:
        child = subprocess.Popen([sys.executable, "-c", LISTENER,
                                  str(server.getsockname()[1]), str(HEARTBEAT)],
                                 stdout=subprocess.PIPE, text=True)
        try:
            peer, _ = server.accept()
            assert child.stdout is not None
            assert json.loads(child.stdout.readline()) == {"waiting": True}
            child.send_signal(signal.SIGSTOP)
            peer.sendall(encode(message("bye", reason="done")))
            time.sleep(HEARTBEAT * MISSED_PINGS * 3)  # the stop outlasts the limit
            child.send_signal(signal.SIGCONT)
            assert json.loads(child.stdout.readline()) == {"got": "bye"}
            peer.close()
        finally:
            child.kill()
            child.wait()


async def test_a_silent_peer_is_lost_after_the_missed_pings() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        reader, writer = await asyncio.open_connection(*server.getsockname())
        peer, _ = server.accept()
    connection = ControlConnection(reader, writer, HEARTBEAT, "peer")
    loop = asyncio.get_running_loop()
    began = loop.time()
    with pytest.raises(PeerLost, match="sent nothing"):
        await connection.recv()
    assert loop.time() - began >= HEARTBEAT * MISSED_PINGS
    connection.close()
    peer.close()
