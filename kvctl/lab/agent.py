"""The agent inside a lab node: runs commands for ``kvctl lab exec``.

One TCP connection per request, reached from the host through QEMU's port
forwarding on loopback. Requests: ``ping``; ``exec`` (argv, cwd, env), whose
stdout and stderr stream back as they come, then the exit code;
``poweroff``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import socketserver
import subprocess
import threading
from typing import Any

from . import wire


class _Handler(socketserver.BaseRequestHandler):
    request: socket.socket

    def handle(self) -> None:
        msg = wire.recv(self.request)
        if msg is None:
            return
        op = msg.get("op")
        if op == "ping":
            wire.send(self.request, {"t": "pong", "node": self.server.node})  # type: ignore[attr-defined]
        elif op == "exec":
            self._exec(msg)
        elif op == "poweroff":
            wire.send(self.request, {"t": "bye"})
            os.sync()
            with open("/proc/sysrq-trigger", "w") as trigger:
                trigger.write("o")
        else:
            wire.send(self.request, {"t": "error", "message": f"unknown op {op!r}"})

    def _exec(self, msg: dict[str, Any]) -> None:
        lock = threading.Lock()
        process: subprocess.Popen[bytes] | None = None

        def send(frame: dict[str, Any]) -> None:
            try:
                with lock:
                    wire.send(self.request, frame)
            except OSError:
                # The caller went away (Ctrl-C): do not leave its command running.
                if process is not None and process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)
                raise

        try:
            process = subprocess.Popen(
                [str(a) for a in msg["argv"]], cwd=msg.get("cwd") or "/",
                env={str(k): str(v) for k, v in (msg.get("env") or {}).items()},
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True)
        except OSError as exc:
            send({"t": "err", "data": f"kvwire-lab: cannot run {msg['argv'][0]}: {exc}\n".encode()})
            send({"t": "exit", "code": 127})
            return

        def pump(stream: Any, kind: str) -> None:
            try:
                for chunk in iter(lambda: stream.read1(65536), b""):
                    send({"t": kind, "data": chunk})
            except OSError:
                return

        pumps = [threading.Thread(target=pump, args=(process.stdout, "out")),
                 threading.Thread(target=pump, args=(process.stderr, "err"))]
        for thread in pumps:
            thread.start()
        code = process.wait()
        for thread in pumps:
            thread.join()
        with contextlib.suppress(OSError):
            send({"t": "exit", "code": code})


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


def main() -> None:
    parser = argparse.ArgumentParser(description="kvwire lab node agent")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--node", required=True)
    args = parser.parse_args()
    with _Server(("0.0.0.0", args.port), _Handler) as server:
        server.node = args.node  # type: ignore[attr-defined]
        print(f"kvwire-lab: agent of {args.node} listening on {args.port}", flush=True)
        server.serve_forever()


if __name__ == "__main__":
    main()
