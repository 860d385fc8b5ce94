"""What /proc says of a process (kvctl.processes), read from real processes."""

from __future__ import annotations

import os
import subprocess
import sys

from kvctl.processes import alive, holdings


def test_holdings_count_what_the_process_holds() -> None:
    before = holdings(os.getpid())
    held = bytearray(64 * 2**20)
    for page in range(0, len(held), 4096):
        held[page] = 1  # touched, so resident
    read, write = os.pipe()
    try:
        after = holdings(os.getpid())
    finally:
        os.close(read)
        os.close(write)
    assert 0 < after.anon_bytes <= after.rss_bytes
    assert after.anon_bytes - before.anon_bytes >= 60 * 2**20
    assert after.fds >= before.fds + 2  # the pipe (other threads may open more)
    del held


def test_a_reaped_process_is_not_alive() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    assert alive(child.pid)
    assert holdings(child.pid).fds >= 3  # another process's: its stdin, stdout, stderr
    child.communicate(b"")
    assert not alive(child.pid)
