"""Whether a process is still running: one answer for the lab, the
namespace session and the test suite."""

from __future__ import annotations

import contextlib
import os
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
