"""No process of a test run outlives it.

Every process the suite starts (daemons, kvctl, QEMU, Prometheus) inherits a
mark in its environment, so the run can find them afterwards even when they
left their process group or lost their parent. A run that leaves one behind
fails, names it, and kills it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from kvctl.processes import alive

MARK = "KVWIRE_TEST_RUN"
# Daemons told to stop may still be draining when the last test ends.
GRACE = 15.0


def marked_processes(mark: str) -> dict[int, str]:
    """Live processes (not this one) whose environment carries ``mark``: pid -> command."""
    needle = f"{MARK}={mark}".encode()
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            if not alive(int(entry.name)):
                continue  # exited (a zombie waiting for its parent to reap it)
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(
                errors="replace").strip()
            found[int(entry.name)] = command
    return found


def reap_leftovers(mark: str, grace: float = GRACE) -> dict[int, str]:
    """Wait up to ``grace`` for marked processes to end; kill and return those left."""
    deadline = time.monotonic() + grace
    while (left := marked_processes(mark)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left
