"""How much slower the lab's emulated cores run Python than this host's.

The nodes are QEMU guests under TCG, emulated instruction by instruction, so
the CPU a daemon spends per write in them is what an emulated core spends.
The same loop of what a post does in Python (packing a header, keeping it in
a dict), timed in a node and here, gives the factor that reads it as one of
this host's cores would spend it. It is a factor for the interpreter's own
work; the kernel's (system time) is emulated otherwise and not scaled.
"""

from __future__ import annotations

import io
import subprocess
import sys

from .machine import LabError, LabState, exec_in

# Prints its own CPU seconds: process start-up is left out.
LOOP = """
import struct, time
pack = struct.Struct("<BBxxIIIQQ").pack
kept = {}
started = time.process_time()
for n in range(200_000):
    kept[n & 255] = pack(1, 0, n & 0xFFFF, 0, 512, n, n)
print(time.process_time() - started)
"""
TRIES = 3  # the least of three: a try that met another process's work is slower


def _seconds(output: str, where: str) -> float:
    try:
        return float(output.strip().splitlines()[-1])
    except (ValueError, IndexError) as exc:
        raise LabError(f"the CPU speed loop printed no time {where}: {output[-300:]!r}") from exc


def here() -> float:
    """The loop's CPU seconds on this host, the least of ``TRIES``."""
    return min(_seconds(subprocess.run([sys.executable, "-c", LOOP], capture_output=True,
                                       text=True, check=True).stdout, "here")
               for _ in range(TRIES))


def in_node(state: LabState, node: str) -> float:
    """The loop's CPU seconds in ``node``, the least of ``TRIES``."""
    times = []
    for _ in range(TRIES):
        out, err = io.BytesIO(), io.BytesIO()
        code = exec_in(node, [sys.executable, "-c", LOOP], stdout=out, stderr=err,
                       state=state)
        if code != 0:
            raise LabError(f"the CPU speed loop failed in {node} ({code}): "
                           f"{err.getvalue().decode(errors='replace')[-300:]}")
        times.append(_seconds(out.getvalue().decode(errors="replace"), f"in {node}"))
    return min(times)


def slowdown(state: LabState, node: str) -> float:
    """How many times slower ``node`` runs the loop than this host."""
    return in_node(state, node) / here()
