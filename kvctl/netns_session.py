"""``kvctl netns up|env|status|down``: the demo's two hosts, left running.

``kvctl demo netns`` builds two namespaces, runs its pushes and tears
everything down. ``kvctl netns up`` builds the same pair and leaves the
receiver and the sender running, so an engine on this machine (docs/engines.md's
example, say) can use them: their unix sockets live in the shared
filesystem, and ``kvctl netns env`` prints the variables that point the
client library at them. ``kvctl netns down`` stops both and removes the
namespaces.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import sys
import time
import zlib
from pathlib import Path
from typing import Any

from kvwired.client import RECEIVER_SOCKET_VARIABLE, SENDER_SOCKET_VARIABLE
from kvwired.localsock import accepts

from .netns import DaemonProcess, HarnessError, NetnsPair, receiver_config, sender_config
from .processes import alive

DEFAULT_STATE_DIR = Path("/run/kvwire-netns")
STATE_DIR = Path(os.environ.get("KVWIRE_NETNS_DIR", DEFAULT_STATE_DIR))
STOP_PATIENCE = 10.0


def _tag() -> str:
    """Namespaces kvw-session-p and kvw-session-d, or tagged after another state
    directory: pairs of different directories never collide (the test
    harness tags its own by process id)."""
    if STATE_DIR == DEFAULT_STATE_DIR:
        return "session"
    return f"s{zlib.crc32(str(STATE_DIR.resolve()).encode()):08x}"


def _state_file() -> Path:
    return STATE_DIR / "state.json"


def _read_state() -> dict[str, Any] | None:
    try:
        state: dict[str, Any] = json.loads(_state_file().read_text())
    except (OSError, ValueError):
        return None
    return state


def up() -> dict[str, Any]:
    """Build the pair and start both daemons, detached; their state."""
    if _read_state() is not None:
        raise HarnessError(f"a two-namespace pair is already up (state in {STATE_DIR})",
                           hint="`kvctl netns status` shows it; `kvctl netns down` removes it")
    STATE_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
    pair = NetnsPair(_tag()).up()
    daemons: list[DaemonProcess] = []
    try:
        for host, role, config in (
                (pair.decode, "receiver", receiver_config(pair, STATE_DIR)),
                (pair.prefill, "sender", sender_config(pair, STATE_DIR))):
            daemons.append(DaemonProcess(pair, host, role, config, STATE_DIR).start(detach=True))
    except BaseException:
        for daemon in daemons:
            daemon.stop()
        pair.down()
        raise
    state: dict[str, Any] = {
        "prefill": {"netns": pair.prefill.netns, "address": pair.prefill.address},
        "decode": {"netns": pair.decode.netns, "address": pair.decode.address},
        "daemons": {d.role: {"pid": d.pid, "socket": d.socket, "log": str(d.log_path),
                             "netns": d.host.netns} for d in daemons},
    }
    _state_file().write_text(json.dumps(state, indent=2))
    return state


def down() -> list[str]:
    """Stop the daemons (SIGTERM, then SIGKILL), remove the namespaces and the state."""
    state = _read_state()
    report: list[str] = []
    daemons: dict[str, Any] = state.get("daemons", {}) if state else {}
    for role, info in daemons.items():
        pid = int(info["pid"])
        if not alive(pid):
            continue
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_PATIENCE
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
            report.append(f"{role} (pid {pid}): killed after {STOP_PATIENCE:g} s")
        else:
            report.append(f"{role} (pid {pid}): stopped")
    NetnsPair(_tag()).down()
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(STATE_DIR)
    return report


def environment(state: dict[str, Any]) -> dict[str, str]:
    daemons = state["daemons"]
    return {SENDER_SOCKET_VARIABLE: daemons["sender"]["socket"],
            RECEIVER_SOCKET_VARIABLE: daemons["receiver"]["socket"]}


def add_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    netns = commands.add_parser("netns", help="the demo's two namespaces and daemons, "
                                "left running for engines on this machine")
    verbs = netns.add_subparsers(dest="netns_command", required=True, metavar="ACTION")
    verbs.add_parser("up", help="build the pair, start a receiver and a sender (TCP, mutual "
                     "TLS); returns once both serve").set_defaults(handler=_up)
    verbs.add_parser("env", help="shell lines that point engines here at the two daemons: "
                     "eval \"$(kvctl netns env)\"").set_defaults(handler=_env)
    verbs.add_parser("status", help="the pair, the daemons and whether they serve"
                     ).set_defaults(handler=_status)
    verbs.add_parser("down", help="stop both daemons and remove the namespaces"
                     ).set_defaults(handler=_down)


def _up(args: argparse.Namespace) -> int:
    _print(up())
    return 0


def _down(args: argparse.Namespace) -> int:
    for line in down():
        print(line)
    print("netns pair down")
    return 0


def _env(args: argparse.Namespace) -> int:
    current = _read_state()
    if current is None:
        print(NO_PAIR, file=sys.stderr)
        return 1
    for name, value in environment(current).items():
        print(f"export {name}={shlex.quote(value)}")
    return 0


def _status(args: argparse.Namespace) -> int:
    current = _read_state()
    if current is None:
        print(NO_PAIR)
        return 1
    return _print(current)


NO_PAIR = "no two-namespace pair (start one with `kvctl netns up`)"


def _print(state: dict[str, Any]) -> int:
    prefill, decode, daemons = state["prefill"], state["decode"], state["daemons"]
    print(f"prefill {prefill['address']} ({prefill['netns']}) -> decode {decode['address']} "
          f"({decode['netns']}): TCP over veth, mutual TLS")
    serving = True
    for role, info in daemons.items():
        up_now = alive(int(info["pid"])) and accepts(info["socket"])
        serving &= up_now
        print(f"{role:8}  pid {info['pid']:<7}  {'serving' if up_now else 'NOT SERVING'}  "
              f"socket {info['socket']}  log {info['log']}")
    print('engines on this machine: eval "$(kvctl netns env)"')
    return 0 if serving else 1
