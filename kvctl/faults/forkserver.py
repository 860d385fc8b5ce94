"""Warm engines for a lab node: import once, fork one engine per push.

An engine is a new Python process per push so that a scenario can SIGKILL
it, but on an emulated one-vCPU node starting Python and importing numpy,
asyncio and the client library takes 3 to 9 s, more than the push itself.
This server pays that once: it imports the engine module, then forks a
child for every command file that appears in its directory. A child is a
real process with a pid of its own, killed as any other.

    python -m kvctl.faults.forkserver DIR

Commands are files ``DIR/<id>.cmd`` holding the engine's argv as JSON (a
lab node's commands have no stdin; the lab's shared directory reaches every
node). The server writes one line per child event on its stdout:
``<id> <line>`` for every line the child prints, ``<id> {"e": "exit",
"code": N}`` when it has ended. ``DIR/stop`` ends the server and its
children. It is single-threaded on purpose: a fork of a threaded process
can inherit a held lock.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import sys
from pathlib import Path

from . import engine

# Seconds between looks at the command directory. Each look is a directory
# read over the lab's 9p share: at 50 a second the server alone took a
# quarter of the node's one emulated CPU, and the daemons started slower.
POLL = 0.2


def _emit(child: str, line: bytes) -> None:
    os.write(1, child.encode() + b" " + line.rstrip(b"\n") + b"\n")


def _spawn(argv: list[str]) -> tuple[int, int]:
    """Fork an engine whose stdout is a pipe back to the server; its pid and
    the pipe's read end."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: an engine process, as if started afresh
        code = 1
        try:
            os.close(read_end)
            os.dup2(write_end, 1)
            os.close(write_end)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            sys.stdout = os.fdopen(1, "w", buffering=1)
            code = engine.main(argv)
        finally:
            sys.stdout.flush()
            os._exit(code)
    os.close(write_end)
    return pid, read_end


def serve(directory: Path) -> int:
    directory.mkdir(parents=True, exist_ok=True)
    selector = selectors.DefaultSelector()
    children: dict[int, tuple[str, int, bytearray]] = {}  # fd -> (id, pid, partial line)
    _emit("server", json.dumps({"e": "ready", "pid": os.getpid()}).encode())
    while not (directory / "stop").exists():
        for command in sorted(p for p in directory.iterdir() if p.suffix == ".cmd"):
            child = command.stem
            try:
                argv = json.loads(command.read_text())
            except (OSError, ValueError):
                continue  # still being written: the host renames it into place
            command.unlink()
            pid, fd = _spawn([str(a) for a in argv])
            children[fd] = (child, pid, bytearray())
            selector.register(fd, selectors.EVENT_READ)
        for key, _ in selector.select(timeout=POLL):
            fd = int(key.fd)
            child, pid, partial = children[fd]
            data = os.read(fd, 65536)
            partial += data
            *lines, rest = bytes(partial).split(b"\n")
            partial[:] = rest
            for line in lines:
                _emit(child, line)
            if not data:  # the child's stdout closed: it has ended
                selector.unregister(fd)
                os.close(fd)
                del children[fd]
                _, status = os.waitpid(pid, 0)
                _emit(child, json.dumps({"e": "exit",
                                         "code": os.waitstatus_to_exitcode(status)}).encode())
    for _, pid, _ in children.values():
        os.kill(pid, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(serve(Path(sys.argv[1])))
