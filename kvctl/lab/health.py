"""Whether the lab's wires pass packets, and what the nodes say when they do not.

Each rail is checked the way a push would find it dead: a connection
attempt from prefill to decode's address on that rail. A wire that stopped passing packets while
both nodes answer their agents is the lab's fault, not kvwire's; what the
nodes' kernels, links and neighbour tables say then is what
``diagnose`` collects, for the person reading a failed run.
"""

from __future__ import annotations

import sys

from .machine import LabError, LabState, console_tail, run_in

DIAGNOSTICS = (
    ("links", ["ip", "-s", "link", "show"]),
    ("neighbours", ["ip", "neigh", "show"]),
    ("queueing", ["tc", "qdisc", "show"]),
    ("memory", ["free", "-m"]),
    ("kernel log", ["sh", "-c", "dmesg | tail -n 40"]),
)


# A TCP connection attempt to a port nobody serves: a reset ("refused") or an
# answer proves the wire carried packets both ways (ARP included); "no route
# to host" or silence proves it did not. (No ping: Debian's minimal
# installs have none.)
_REACHES = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], 1), float(sys.argv[2])).close()
except ConnectionRefusedError:
    pass
except OSError as exc:
    sys.exit(f"{exc.strerror or exc}")
"""


def broken_rails(state: LabState, timeout: float = 3.0) -> list[str]:
    """Each rail on which prefill does not reach decode, said why."""
    broken = []
    decode = state.nodes["decode"]
    for rail, address in enumerate(decode.rail_addresses or [decode.wire_address]):
        code, out, err = run_in("prefill", [sys.executable, "-c", _REACHES, address,
                                            f"{timeout:g}"], state=state)
        if code != 0:
            last = (out + err).strip().splitlines()[-1:] or ["no answer"]
            broken.append(f"wire{rail} ({address}): {last[0]}")
    return broken


def bounce(state: LabState) -> None:
    """Take every wire NIC down and up in both nodes: their queues start over."""
    for node in state.nodes:
        rails = len(state.nodes[node].rail_addresses) or 1
        script = "; ".join(f"ip link set wire{r} down; ip link set wire{r} up"
                           for r in range(rails))
        run_in(node, ["sh", "-c", script], state=state)


def diagnose(state: LabState) -> str:
    """What each node's links, neighbours, queues, memory and kernel say."""
    parts = []
    for node in state.nodes.values():
        for title, argv in DIAGNOSTICS:
            try:
                code, out, err = run_in(node.name, argv, state=state)
                text = (out + err).strip() or f"(exit {code}, no output)"
            except LabError as exc:
                text = f"(cannot ask: {exc})"
            parts.append(f"--- {node.name}: {title}\n{text}")
        parts.append(f"--- {node.name}: console and QEMU log\n"
                     f"{console_tail(node, 40).strip()}")
    return "\n".join(parts)
