"""How long the wire itself needs for a push's bytes, and the deadline that follows.

A push's deadline must not be what fails it on a wire that is merely slow:
before a wire scenario's iterations, the campaign puts the fault on the
wire and times the plain tool for the transport moving the same bytes in
the same write sizes (``ib_write_bw`` over verbs; a socket loop,
``sendall``/``recv_into`` and nothing else, over TCP). The pushes then get
``DEADLINE_FACTOR`` times that, and never less than ``DEADLINE_FLOOR``. A
push that still fails is kvwire's to explain; one that the tool itself
cannot finish within ``REFERENCE_LIMIT`` is the wire's.

Run as ``python -m kvctl.faults.reference serve|send`` it is the socket
loop's two halves, one in each namespace of a netns deployment.
"""

from __future__ import annotations

import argparse
import sys
import threading
from dataclasses import dataclass
from typing import Any

from kvwired.experiments.socket_loop import LoopServer, LoopSpec, send

DEADLINE_FLOOR = 20.0  # a push's deadline on a clean wire, as before it followed the wire
DEADLINE_FACTOR = 2.0
# The longest the tool is given: a wire that cannot carry the push's bytes
# in this long is reported as such, and the pushes keep the floor.
REFERENCE_LIMIT = 300.0


@dataclass(frozen=True)
class WireReference:
    """The tool's time for one push's bytes on a scenario's wire."""

    tool: str
    total_bytes: int
    seconds: float | None  # None: it did not finish (``why`` says how it ended)
    why: str | None = None

    @property
    def deadline(self) -> float:
        """The push deadline this wire earns."""
        if self.seconds is None:
            return DEADLINE_FLOOR
        return max(DEADLINE_FLOOR, DEADLINE_FACTOR * self.seconds)

    def to_dict(self) -> dict[str, Any]:
        return {"tool": self.tool, "bytes": self.total_bytes,
                "seconds": None if self.seconds is None else round(self.seconds, 3),
                "why": self.why, "push_deadline": round(self.deadline, 1)}

    def describe(self) -> str:
        """One line for the report."""
        mib = self.total_bytes / (1 << 20)
        if self.seconds is None:
            return (f"{self.tool} did not move the push's {mib:g} MiB on this wire "
                    f"({self.why}); pushes had the {DEADLINE_FLOOR:g} s floor")
        return (f"{self.tool} moved the push's {mib:g} MiB in {self.seconds:.2f} s on this "
                f"wire; pushes had {self.deadline:.0f} s")


# ------------------------------------------------------ the socket loop's halves


def _serve(host: str, total: int) -> int:
    server = LoopServer(host, total)
    print(server.port, flush=True)  # the sender's half dials it
    # Ends when the sender closes; a sender that never comes ends the
    # listener's accept after the loop's idle limit.
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    thread.join()
    return 0


def _send(host: str, port: int, size: int, chunks: int) -> int:
    [seconds] = send(host, port, LoopSpec(size, chunks, 1))
    print(f"{seconds:.6f}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvctl.faults.reference")
    halves = parser.add_subparsers(dest="half", required=True)
    serve = halves.add_parser("serve", help="receive one push's bytes; prints the port")
    serve.add_argument("host")
    serve.add_argument("total", type=int)
    sender = halves.add_parser("send", help="send them; prints the seconds taken")
    sender.add_argument("host")
    sender.add_argument("port", type=int)
    sender.add_argument("size", type=int)
    sender.add_argument("chunks", type=int)
    args = parser.parse_args(argv)
    if args.half == "serve":
        return _serve(args.host, args.total)
    return _send(args.host, args.port, args.size, args.chunks)


if __name__ == "__main__":
    sys.exit(main())
