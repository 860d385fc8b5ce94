"""What /proc says of a process: whether it still runs (one answer for the
lab, the namespace session and the test suite) and what it holds (for the
soak benchmark and the tests that watch a daemon's memory)."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path


def alive(pid: int) -> bool:
    """True while ``pid`` runs. A zombie (exited, not yet reaped by its parent,
    as the lab's QEMUs are when `up` ran in the same process) is not alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].startswith("Z"):
            return False
    return True


@dataclass(frozen=True)
class Holdings:
    """What a process holds now: resident memory, the anonymous part of it
    (the heap, where a per-session leak shows; file-backed pages come and go
    with the page cache), and open file descriptors."""

    rss_bytes: int
    anon_bytes: int
    fds: int


def holdings(pid: int) -> Holdings:
    """``pid``'s resident and anonymous memory (/proc/PID/status, which counts
    in KiB) and its open descriptors (/proc/PID/fd; reading another user's
    needs root)."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        fields[name] = value.split()
    return Holdings(rss_bytes=int(fields["VmRSS"][0]) * 1024,
                    anon_bytes=int(fields["RssAnon"][0]) * 1024,
                    fds=len(list(Path(f"/proc/{pid}/fd").iterdir())))
