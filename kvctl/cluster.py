"""``kvctl cluster``: the receivers in the etcd registry, and whether this
node's sender is connected to each."""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from kvwired.addresses import SENDER_METRICS_PORT
from kvwired.discovery.address import RegistryAddress
from kvwired.discovery.membership import BadMemberRecord, Member
from kvwired.errors import DaemonUnavailable
from kvwired.protocol import PROTOCOL_VERSION
from kvwired.units import format_size

from .status import DaemonStatus, scrape
from .table import render

HEADERS = ["receiver", "state", "control", "transport", "pool used", "pool", "sender"]


def add_parser(commands: Any) -> None:
    cluster = commands.add_parser(
        "cluster", help="the receivers in the etcd registry (discovery), their pool use, "
        "and whether the local sender is connected to them")
    cluster.set_defaults(handler=main)
    cluster.add_argument("discovery", help="the registry, as in the daemons' config: "
                         "etcd://HOST:PORT/CLUSTER")
    cluster.add_argument("--sender-metrics", default=f"127.0.0.1:{SENDER_METRICS_PORT}",
                         help="the local sender's metrics endpoint, for the sender column "
                         "(default: %(default)s)")
    cluster.add_argument("--json", action="store_true")


def main(args: argparse.Namespace) -> int:
    address = RegistryAddress.parse(args.discovery)
    records = asyncio.run(_read(address))
    sender = scrape(args.sender_metrics)
    rows = [describe(name, raw, sender) for name, raw in records]
    if args.json:
        print(json.dumps({"registry": str(address), "members": rows}, indent=2))
    else:
        print(f"{address}: {len(rows)} receivers")
        print(render(HEADERS, [[r["name"], r["state"], r["control"], r["transport"],
                                r["pool_used"], r["pool"], r["sender"]] for r in rows]))
    return 0


async def _read(address: RegistryAddress) -> list[tuple[str, bytes]]:
    from kvwired.discovery.registry import read_members

    try:
        return await asyncio.wait_for(read_members(address), 10)
    except Exception as exc:  # gRPC's errors, a timeout: the registry is not there
        raise DaemonUnavailable(
            f"cannot read the registry {address}: {type(exc).__name__}: {exc}",
            hint="is etcd running there, and reachable from this node?") from None


def describe(name: str, raw: bytes, sender: DaemonStatus) -> dict[str, Any]:
    """One registry record as a row (a record that does not decode says why)."""
    try:
        member = Member.decode(name, raw)
    except BadMemberRecord as exc:
        return {"name": name, "state": f"bad record: {exc.message}", "control": "-",
                "transport": "-", "pool_used": "-", "pool": "-", "sender": "-"}
    state = "live" if member.protocol == PROTOCOL_VERSION else (
        f"protocol {member.protocol}, not {PROTOCOL_VERSION}: not used")
    if not sender.up:
        connected = "no sender here"
    elif sender.total("kvwire_peer_up", peer=member.name) >= 1:
        connected = "connected"
    else:
        connected = "not connected"
    used = member.pool_bytes - member.pool_free
    return {"name": member.name, "state": state, "control": member.control,
            "transport": member.transport, "pool_used": format_size(used),
            "pool": format_size(member.pool_bytes), "sender": connected,
            "pool_free_bytes": member.pool_free, "identity": member.identity}
