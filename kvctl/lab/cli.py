"""``kvctl lab up|status|exec|down``."""

from __future__ import annotations

import argparse
import sys

from kvwired.addresses import DEFAULT_CONTROL_PORT, RECEIVER_METRICS_PORT, SENDER_METRICS_PORT

from .. import table
from . import machine
from .health import broken_rails


def add_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    lab = commands.add_parser("lab", help="two QEMU nodes with Soft-RoCE on this machine")
    verbs = lab.add_subparsers(dest="lab_command", required=True, metavar="ACTION")
    up = verbs.add_parser("up", help="boot nodes prefill and decode; returns when both are ready")
    up.set_defaults(handler=_up)
    up.add_argument("--rails", type=int, default=1, metavar="N",
                    help=f"wire NICs per node, each with its own rxe device and subnet "
                         f"(1 to {machine.MAX_RAILS}; default 1)")
    verbs.add_parser("status", help="nodes, addresses, and the host ports that reach them"
                     ).set_defaults(handler=_status)
    verbs.add_parser("down", help="power the nodes off and remove everything of the lab"
                     ).set_defaults(handler=_down)
    run = verbs.add_parser("exec", help="run a command in a node: kvctl lab exec NODE -- CMD")
    run.set_defaults(handler=_exec)
    run.add_argument("node", choices=[n.name for n in machine.NODES])
    run.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD ...")


def _up(args: argparse.Namespace) -> int:
    state = machine.up(rails=args.rails)
    wires = ", ".join(f"wire{rail}" for rail in range(state.rails))
    print(f"lab up in {state.booted_seconds:.1f} s (kernel {state.kernel}, software "
          f"emulation, rdma_rxe on each node's {wires})")
    _print_nodes(state, {name: "up" for name in state.nodes})
    return 0


def _status(args: argparse.Namespace) -> int:
    current, health = machine.status()
    if current is None:
        print("no lab (start one with `kvctl lab up`)")
        return 1
    _print_nodes(current, health)
    if not all(h == "up" for h in health.values()):
        return 1
    broken = broken_rails(current)
    for rail in broken:
        print(f"wire down: {rail} (prefill does not reach decode; "
              "`kvctl lab down` and `up` gives a new one)")
    if not broken:
        print("every wire passes packets (prefill reaches decode on each)")
    return 1 if broken else 0


def _down(args: argparse.Namespace) -> int:
    for line in machine.down():
        print(line)
    print("lab down")
    return 0


def _exec(args: argparse.Namespace) -> int:
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        print("kvctl lab exec: give a command after --", file=sys.stderr)
        return 2
    return machine.exec_in(args.node, argv)


def _print_nodes(state: machine.LabState, health: dict[str, str]) -> None:
    rows = []
    for name, node in state.nodes.items():
        ports = node.ports
        addresses = node.rail_addresses or [node.wire_address]
        wires = ", ".join(f"{address} (wire{rail}, rxe{rail})"
                          for rail, address in enumerate(addresses))
        rows.append([name, health.get(name, "?"), wires,
                     f"127.0.0.1:{ports['agent']}", f"127.0.0.1:{ports['control']}",
                     f"127.0.0.1:{ports['metrics_receiver']}",
                     f"127.0.0.1:{ports['metrics_sender']}"])
    print(table.render(["node", "state", "wire addresses", "agent",
                        f"control :{DEFAULT_CONTROL_PORT}",
                        f"receiver metrics :{RECEIVER_METRICS_PORT}",
                        f"sender metrics :{SENDER_METRICS_PORT}"], rows))
    print(f"consoles: {machine.STATE_DIR}/<node>.console")
