"""Faults on the wire: ``tc netem`` where the kernel has it, else nftables.

netem does everything a scenario asks for (loss, delay, jitter, reordering,
duplication, corruption). Kernels built without it (CONFIG_NET_SCH_NETEM)
still have nf_tables: random loss (``numgen random``) and a blackout (drop
everything) are expressible there, the rest is not, and such a scenario is
reported as not run, with the reason.
"""

from __future__ import annotations

import functools
import re
import subprocess
from collections.abc import Callable

Argv = Callable[[list[str]], list[str]]  # a command, as run on one node
TABLE = "kvwire_faults"
_LOSS = re.compile(r"^loss (\d+(?:\.\d+)?)%$")


@functools.cache
def netem_available() -> bool:
    """Whether this kernel has the netem qdisc (built in, or a module to load)."""
    if subprocess.run(["modprobe", "-q", "sch_netem"], capture_output=True).returncode == 0:
        return True
    try:
        import gzip

        with gzip.open("/proc/config.gz", "rt") as config:
            return "CONFIG_NET_SCH_NETEM=y" in config.read()
    except OSError:
        return False


class WireFaults:
    def can_emulate(self, netem: str) -> str | None:
        """None if ``netem`` can be put on the wire here, else why not."""
        if netem_available() or _LOSS.match(netem):
            return None
        return ("this kernel has no netem (CONFIG_NET_SCH_NETEM) and nftables can only "
                "drop packets; the lab's nodes have netem")

    def apply(self, on_node: Argv, ifname: str, netem: str | None) -> None:
        if netem_available():
            self._netem(on_node, ifname, netem)
        else:
            self._nft(on_node, ifname, netem)

    @staticmethod
    def _netem(on_node: Argv, ifname: str, netem: str | None) -> None:
        if netem is None:
            subprocess.run(on_node(["tc", "qdisc", "del", "dev", ifname, "root"]),
                           capture_output=True)
            return
        _run(on_node(["tc", "qdisc", "replace", "dev", ifname, "root", "netem",
                      *netem.split()]), f"tc netem {netem}")

    @staticmethod
    def _nft(on_node: Argv, ifname: str, netem: str | None) -> None:
        subprocess.run(on_node(["nft", "delete", "table", "inet", TABLE]), capture_output=True)
        if netem is None:
            return
        match = _LOSS.match(netem)
        if match is None:
            raise RuntimeError(f"cannot put {netem!r} on the wire: no netem in this kernel")
        per_million = round(float(match[1]) * 10_000)
        drop = ("drop" if per_million >= 1_000_000
                else f"numgen random mod 1000000 < {per_million} drop")
        # Both directions of the node's wire interface, loopback untouched.
        _run(on_node(["nft", "-f", "-"]), f"nft {netem}", stdin=(
            f"table inet {TABLE} {{\n"
            f"  chain out {{ type filter hook output priority 0; oifname \"{ifname}\" {drop}; }}\n"
            f"  chain in {{ type filter hook input priority 0; iifname \"{ifname}\" {drop}; }}\n"
            "}\n"))


DROP_TABLE = "kvwire_inbound_drop"
# Runs a command on the node; its exit code and error output.
Run = Callable[[list[str]], tuple[int, str]]


def drop_inbound(run: Run, matches: list[str]) -> None:
    """Drop, on arrival at a node, every packet that one of ``matches`` (nft
    expressions such as ``tcp dport 7472``) selects: that path goes silent,
    no reset, and the rest is left alone (the data path cut with the control
    connection healthy, say). One nft command line, so that it needs no
    standard input (a lab node's commands have none)."""
    undo_drop_inbound(run)
    commands = [f"add table inet {DROP_TABLE}",
                f"add chain inet {DROP_TABLE} in {{ type filter hook input priority 0; }}",
                *(f"add rule inet {DROP_TABLE} in {match} drop" for match in matches)]
    code, err = run(["nft", "; ".join(commands)])
    if code != 0:
        raise RuntimeError(f"nft drop {', '.join(matches)}: {err.strip()}")


def undo_drop_inbound(run: Run) -> None:
    """Undo ``drop_inbound`` (a no-op when nothing is dropped)."""
    run(["nft", "delete", "table", "inet", DROP_TABLE])


def _run(argv: list[str], what: str, stdin: str | None = None) -> None:
    done = subprocess.run(argv, input=stdin, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{what}: {done.stderr.strip()}")
