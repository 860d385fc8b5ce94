"""The import rule of docs/DESIGN.md ("Layers of the code"), checked, and beside it
the rules on a module's size and on private state.

Every import in kvwired/, kvctl/ and kvwire_vllm/ counts: at module level, inside
functions and under ``TYPE_CHECKING``, because each is a dependency someone
reading the code has to hold in mind. A new module must be placed in a
layer here before it can land.
"""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kvwired", "kvctl", "kvwire_vllm")

# Bottom to top. A module may import its own layer and those its layer names.
LAYERS: dict[str, tuple[str, ...]] = {
    "base": ("kvwired", "kvwired.errors", "kvwired.units", "kvwired.immediate", "kvwired.addresses",
             "kvwired.tasks", "kvwired.logs", "kvwired.systemd", "kvwired.analysis",
             "kvwired.stripes", "kvwired.tracing"),
    "model": ("kvwired.layout", "kvwired.checksum", "kvwired.protocol", "kvwired.protocol.*",
              "kvwired.verdicts",
              "kvwired.config",
              "kvwired.pool", "kvwired.rdma", "kvwired.metrics", "kvwired.stream",
              "kvwired.lifecycle", "kvwired.lifecycle.*", "kvwired.trust", "kvwired.quota",
              "kvwired.discovery", "kvwired.discovery.address", "kvwired.discovery.seal",
              "kvwired.discovery.membership"),
    "transport": ("kvwired.transport", "kvwired.transport.*"),
    "connections": ("kvwired.control", "kvwired.localsock", "kvwired.gate",
                    "kvwired.discovery.registry", "kvwired.discovery.presence"),
    "ports": ("kvwired.ports",),
    "daemons": ("kvwired.daemon", "kvwired.receiver", "kvwired.receiver.*", "kvwired.sender",
                "kvwired.sender.*"),
    "experiments": ("kvwired.experiments", "kvwired.experiments.*"),
    "client": ("kvwired.client", "kvwired.client.*", "kvwired.slot_maps"),
    "wiring": ("kvwired.cli", "kvwired.__main__"),
    "kvctl": ("kvctl", "kvctl.*"),
    "connector": ("kvwire_vllm", "kvwire_vllm.*"),
}

MAY_IMPORT: dict[str, set[str]] = {
    "base": set(),
    "model": {"base"},
    "transport": {"base", "model"},
    "connections": {"base", "model"},
    # The daemons and the experiments are siblings: neither imports the other.
    # The wiring hands experiments to the daemons; experiments see the
    # daemons only through the protocols of kvwired.ports, below both.
    "ports": {"base", "model", "transport", "connections"},
    "daemons": {"base", "model", "transport", "connections", "ports"},
    "experiments": {"base", "model", "transport", "connections", "ports"},
    # What engines import knows nothing of the daemons or the data path.
    "client": {"base", "model", "connections"},
    "wiring": {"base", "model", "transport", "connections", "ports", "daemons",
               "experiments", "client"},
    "kvctl": set(),
    # vLLM's connector is an engine: it knows the daemons only as a client does.
    "connector": {"base", "model", "client"},
}

# kvctl talks to the daemons through their sockets and the client library; of
# kvwired it may use only what a user of the package may.
KVCTL_MAY_IMPORT = ("kvwired", "kvwired.client", "kvwired.errors", "kvwired.units",
                    "kvwired.addresses",
                    "kvwired.layout", "kvwired.checksum", "kvwired.analysis", "kvwired.config",
                    "kvwired.rdma",
                    "kvwired.protocol", "kvwired.protocol.framing", "kvwired.protocol.fields",
                    "kvwired.protocol.common", "kvwired.protocol.sender_local",
                    "kvwired.localsock", "kvwired.trust",
                    "kvwired.experiments.spec", "kvwired.experiments.plan",
                    "kvwired.discovery.address",
                    "kvwired.discovery.membership", "kvwired.discovery.registry",
                    "kvwired.experiments.perftest", "kvwired.experiments.socket_loop",
                    "kvwired.tracing",
                    # The vLLM connector's plain parts: the proxy's transfer ids,
                    # the demo's local model, push names. Never the parts that
                    # import vLLM.
                    "kvwire_vllm", "kvwire_vllm.params", "kvwire_vllm.model",
                    "kvwire_vllm.shards")


# Inside each daemon's package, bottom to top: a part imports only the parts
# before it, and the package's daemon wires them (hands each what it needs).
PARTS: dict[str, tuple[str, ...]] = {
    "kvwired.receiver": ("session", "keys", "leases", "engines", "landing", "channels",
                         "senders", "daemon"),
    "kvwired.sender": ("rails", "ledger", "credits", "requests", "holders", "dial", "channels",
                       "link", "push", "engines", "daemon"),
    "kvwired.client": ("results", "connection", "push", "recovery", "sender", "receiver",
                       "sync"),
    # The transports, mirrored by name where they do the same job.
    "kvwired.transport.verbs": ("send_queue", "core", "device", "gids", "completions", "queue_pair",
                                "keys", "channel", "responder", "transport"),
    "kvwired.transport.tcp": ("frames", "write_receiver", "keys", "socket_options", "channel",
                              "responder", "transport"),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imports_of(name: str) -> set[str]:
    """The kvwired/kvctl modules ``name`` imports, anywhere in its source."""
    path = MODULES[name]
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.add(module)
            # ``from . import x`` imports the module x, not a name in the package.
            found.update(f"{module}.{alias.name}" for alias in node.names
                         if f"{module}.{alias.name}" in MODULES)
    return {m for m in found if m in MODULES and m != name}


def layer_of(name: str) -> str:
    for layer, patterns in LAYERS.items():
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
            return layer
    raise AssertionError(f"{name} is in no layer: place it in tests/unit/test_layering.py "
                         "and in docs/DESIGN.md")


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_import_follows_the_layer_rule(name: str) -> None:
    layer = layer_of(name)
    for imported in sorted(imports_of(name)):
        target = layer_of(imported)
        if layer == "kvctl":
            allowed = target == "kvctl" or imported in KVCTL_MAY_IMPORT
        else:
            allowed = target == layer or target in MAY_IMPORT[layer]
        assert allowed, f"{name} ({layer}) may not import {imported} ({target})"


@pytest.mark.parametrize("package", sorted(PARTS))
def test_a_daemons_parts_import_only_the_parts_below_them(package: str) -> None:
    order = PARTS[package]
    inside = {m for m in MODULES if m.startswith(f"{package}.")}
    assert {m.removeprefix(f"{package}.") for m in inside} == set(order), \
        f"place every module of {package} in PARTS (tests/unit/test_layering.py)"
    for name in sorted(inside):
        rank = order.index(name.removeprefix(f"{package}."))
        for imported in sorted(imports_of(name) & inside):
            assert order.index(imported.removeprefix(f"{package}.")) < rank, \
                f"{name} may not import {imported}: it is not below it in PARTS"


def test_no_import_cycles() -> None:
    graph = {name: imports_of(name) for name in MODULES}
    # A package's __init__ that re-exports its modules is not a cycle with them.
    for name in graph:
        graph[name] = {m for m in graph[name] if not m.startswith(f"{name}.")}
    cycles = _cycles(graph)
    assert not cycles, f"import cycles: {cycles}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_cycles_between_subpackages() -> None:
    """Modules may not form a cycle, and neither may the packages they sit in:
    kvctl's run/ and faults/ once imported each other through modules that
    did not (a shared part belongs below both)."""
    def package(name: str) -> str:
        parts = name.split(".")
        return ".".join(parts[:2]) if len(parts) > 2 or MODULES[name].name == "__init__.py" \
            else parts[0]

    graph: dict[str, set[str]] = {}
    for name in MODULES:
        mine = package(name)
        graph.setdefault(mine, set()).update(
            theirs for m in imports_of(name) if (theirs := package(m)) != mine
            and not theirs.startswith(f"{mine}.") and not mine.startswith(f"{theirs}."))
    for name in list(graph):
        graph[name] = {m for m in graph[name] if m in graph}
    assert not _cycles(graph), f"package cycles: {_cycles(graph)}"


def test_the_rule_catches_a_daemon_importing_an_experiment() -> None:
    # The check itself is tested: the old layout's cycle would fail it.
    graph = {"kvwired.sender": {"kvwired.experiments.chunk_sweep"},
             "kvwired.experiments.chunk_sweep": {"kvwired.sender"}}
    assert _cycles(graph) == [["kvwired.experiments.chunk_sweep", "kvwired.sender"]]
    assert "experiments" not in MAY_IMPORT[layer_of("kvwired.sender.daemon")]


def test_each_test_file_sits_with_what_it_needs() -> None:
    """tests/unit needs nothing but this machine, tests/netns root and namespaces,
    tests/lab the QEMU lab: a file's markers say which, and so does its place."""
    needs = {"unit": set(), "netns": {"netns"}, "lab": {"lab"}}
    for group, marks in needs.items():
        for path in sorted((ROOT / "tests" / group).glob("test_*.py")):
            text = path.read_text()
            found = {mark for mark in ("netns", "lab") if f"pytest.mark.{mark}" in text}
            assert found == marks, f"{path.name} is marked {found or 'for nothing'}, " \
                                   f"but sits in tests/{group}"


MAX_MODULE_LINES = 550
MAX_CLASS_LINES = 330


@pytest.mark.parametrize("name", sorted(m for m in MODULES if m.startswith("kvwired")))
def test_no_daemon_module_or_class_outgrows_one_job(name: str) -> None:
    """A module past 550 lines or a class past 330 has taken a second job:
    split it into parts, as the receiver, the sender's link, the transports
    and the client are."""
    source = MODULES[name].read_text()
    assert source.count("\n") <= MAX_MODULE_LINES, f"{name}: split it into parts"
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            assert lines <= MAX_CLASS_LINES, f"{name}.{node.name} has {lines} lines"


def _map_rows() -> dict[str, set[str]]:
    """docs/DESIGN.md's map of the code: each folder with the names it lists."""
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    section = text.split("## Map of the code", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = set(re.findall(r"`([^`]+)`", cells[1]))
    return rows


def test_the_design_docs_map_of_the_code_matches_the_tree() -> None:
    rows = _map_rows()
    folders = {f"{path.relative_to(ROOT)}/" for pkg in PACKAGES
               for path in [ROOT / pkg, *(ROOT / pkg).rglob("*")]
               if path.is_dir() and (path / "__init__.py").exists()}
    assert set(rows) == folders, "docs/DESIGN.md's map and the tree's packages differ"
    for folder, listed in rows.items():
        here = ROOT / folder
        present = {p.stem for p in here.glob("*.py") if p.name != "__init__.py"}
        present |= {p.name for p in here.glob("*.sh")}
        present |= {f"{p.name}/" for p in here.iterdir() if (p / "__init__.py").exists()}
        assert listed == present, (
            f"docs/DESIGN.md's map of {folder}: lists {sorted(listed - present)} that are "
            f"not there, leaves out {sorted(present - listed)}")


# Private attributes of other libraries that offer no public way to the same
# thing, each with why.
FOREIGN_PRIVATE = {
    "_metrics",  # prometheus_client keeps a labelled metric's children nowhere public
    "_exit",  # os._exit: a forked child must not run the parent's cleanup
    "_make",  # a namedtuple's public constructor (the underscore avoids its fields)
    "_SubParsersAction",  # argparse names no public type for add_subparsers' result
    "_MISSING_TYPE",  # dataclasses names no public type for its MISSING sentinel
}


def _private_reaches(source: str, where: str) -> list[str]:
    """Each ``x._name`` in ``source`` where x is not ``self`` or ``cls``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__") and node.attr not in FOREIGN_PRIVATE
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            found.append(f"{where}:{node.lineno}: .{node.attr}")
    return found


def test_no_code_reaches_into_another_objects_private_state() -> None:
    """What one part needs of another is public and documented: an underscore
    name is read or called only by its own class (or module)."""
    sources = [path for folder in (*PACKAGES, "benchmarks")
               for path in sorted((ROOT / folder).rglob("*.py"))]
    reaches = [reach for path in sources
               for reach in _private_reaches(path.read_text(), str(path.relative_to(ROOT)))]
    assert not reaches, "private state reached from outside its class:\n" + "\n".join(reaches)


def test_the_private_rule_catches_a_reach() -> None:
    source = "def peek(push):\n    return push._timers, self_._x, self._fine, cls._also\n"
    assert _private_reaches(source, "probe") == ["probe:2: ._timers", "probe:2: ._x"]
