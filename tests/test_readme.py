"""The README and the manual in docs/ work as written: their Python runs,
their shell sessions run, the kvctl synopsis says what ``kvctl --help``
says, and every link between the pages leads somewhere.

Every fenced block in README.md and the docs/ pages says what it is:
``python`` (a program, its file name on the first line), ``sh`` (a session,
run here line for line) or ``text`` (sample output, or the synopsis). A new
``sh`` block must be given a place to run in ``SESSIONS`` below, or this
suite fails. docs/DESIGN.md is prose about the code: its links are checked,
its blocks are not run.

This file sorts after test_lab_teardown.py, so the README's lab session
boots its own lab once the suite's shared one is down.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvctl.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# The pages whose examples run: the front page and the manual.
PAGES = [README, *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "DESIGN.md")]
LINKED = [*PAGES, ROOT / "docs" / "DESIGN.md"]
VENV_BIN = str(Path(sys.executable).parent)
KINDS = {"python", "sh", "text"}


@dataclass(frozen=True)
class Block:
    kind: str
    text: str
    line: int  # where it starts in its page, for messages
    page: str = "README.md"

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def first_command(self) -> str:
        return self.text.splitlines()[0].split("#")[0].strip()


def readme_blocks() -> list[Block]:
    return [block for page in PAGES for block in page_blocks(page)]


def page_blocks(page: Path) -> list[Block]:
    name = str(page.relative_to(ROOT))
    blocks: list[Block] = []
    lines = page.read_text().splitlines()
    opened: tuple[str, int] | None = None
    body: list[str] = []
    for number, line in enumerate(lines, 1):
        if not line.startswith("```"):
            if opened is not None:
                body.append(line)
            continue
        if opened is None:
            opened, body = (line[3:].strip(), number), []
        else:
            blocks.append(Block(opened[0], "\n".join(body) + "\n", opened[1], name))
            opened = None
    assert opened is None, f"{name}:{opened[1]}: a code block is never closed"
    return blocks


def blocks_of(kind: str) -> list[Block]:
    return [b for b in readme_blocks() if b.kind == kind]


# Where each shell session runs, by its first command.
SESSIONS = {
    "make demo": "make-dry-run",       # CI runs `make test` itself; `make demo` takes 15 min
    "make demo-vllm": "make-dry-run",  # tests/netns/test_vllm_e2e.py runs its parts
    "kvctl lab up": "host-lab",        # boots its own lab
    "kvctl netns up": "host-netns",    # with the Python blocks beside it
    "make install ROLE=receiver": "lab-node",  # a lab node is a real node, its /etc its own
    "kvctl keys init": "lab-node",
}


def session(first_command: str) -> Block:
    [block] = [b for b in blocks_of("sh") if b.first_command == first_command]
    return block


def _environment(**extra: str) -> dict[str, str]:
    """As after `. .venv/bin/activate`: kvctl and the venv's python3 first."""
    env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
    env.pop("KVWIRE_SENDER_SOCKET", None)
    env.pop("KVWIRE_RECEIVER_SOCKET", None)
    return {**env, **extra}


# ---------------------------------------------------------------- no daemons


def test_every_block_says_what_it_is_and_where_it_runs() -> None:
    blocks = readme_blocks()
    assert blocks, "README.md has no code blocks?"
    for block in blocks:
        assert block.kind in KINDS, (
            f"{block.where}: a code block marked {block.kind!r}; mark it python "
            f"(runs), sh (runs: add it to SESSIONS) or text (output)")
    for block in blocks_of("sh"):
        assert block.first_command in SESSIONS, (
            f"{block.where}: shell session {block.first_command!r} runs nowhere; "
            "say where in tests/test_readme.py SESSIONS")
    for block in blocks_of("python"):
        assert re.match(r"# [\w-]+\.py\b", block.text), (
            f"{block.where}: a Python block starts with '# NAME.py', the file a "
            "reader saves it as")


def _outside_code(text: str) -> str:
    """The page without its fenced blocks (what they hold is not markdown)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings, as GitHub makes them."""
    found = set()
    for heading in re.findall(r"^#+ (.+)$", _outside_code(page.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
        found.add(slug.replace(" ", "-"))
    return found


def test_every_link_between_the_pages_leads_somewhere() -> None:
    checked = 0
    for page in LINKED:
        text = _outside_code(page.read_text())
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # a web address: not ours to check offline
            path, _, fragment = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}: link to {target}"
            assert linked.exists(), f"{where}: no such file"
            if fragment:
                assert fragment in anchors(linked), f"{where}: no such heading there"
            checked += 1
    assert checked >= 10, "the README links to the manual's pages"


def test_the_readme_is_a_front_page_and_links_every_page_of_the_manual() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 250, "README.md is a front page: move detail to docs/"
    for page in PAGES[1:]:
        assert f"(docs/{page.name})" in text, f"README.md does not link docs/{page.name}"


def test_the_two_commands_exist() -> None:
    commands = [words for line in session("make demo").text.splitlines()
                if (words := line.split("#")[0].split())]
    assert [c[:2] for c in commands] == [["make", "demo"], ["make", "test"]]
    result = subprocess.run(["make", "-n", *(c[1] for c in commands)], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _leaves(parser: argparse.ArgumentParser,
            path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], set[str]]]:
    sub = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if sub:
        for name, child in sub[0].choices.items():
            yield from _leaves(child, (*path, name))
        return
    flags = {option for action in parser._actions for option in action.option_strings
             if option.startswith("--") and option != "--help"}
    yield path, flags


def _synopsis() -> dict[tuple[str, ...], set[str]]:
    """README's kvctl synopsis: each command it shows, with the flags it names."""
    [block] = [b for b in blocks_of("text") if b.text.startswith("kvctl ")]
    shown: dict[tuple[str, ...], set[str]] = {}
    for line in block.text.replace("\\\n", " ").splitlines():
        words = line.split("#")[0].split()
        assert words[0] == "kvctl", line
        command = words[1]
        verbs = words[2].split("|") if command in {"run", "lab", "keys", "netns"} else [""]
        flags = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", line.split("#")[0]))
        for verb in verbs:
            shown[(command, verb) if verb else (command,)] = flags
    return shown


def test_every_make_session_names_real_targets() -> None:
    for block in blocks_of("sh"):
        if SESSIONS[block.first_command] != "make-dry-run":
            continue
        for line in block.text.splitlines():
            words = line.split("#")[0].split()
            if words:
                assert words[0] == "make", f"{block.where}: {line}"
                result = subprocess.run(["make", "-n", *words[1:]], cwd=ROOT,
                                        capture_output=True, text=True)
                assert result.returncode == 0, f"{block.where}: {result.stderr}"


def test_the_kvctl_synopsis_says_what_help_says() -> None:
    shown = _synopsis()
    actual = dict(_leaves(build_parser()))
    assert sorted(shown) == sorted(actual), (
        "README's synopsis and kvctl's commands differ: README only "
        f"{sorted(set(shown) - set(actual))}, kvctl only {sorted(set(actual) - set(shown))}")
    for command, flags in actual.items():
        name = " ".join(command)
        missing, extra = flags - shown[command], shown[command] - flags
        assert not missing, f"README's `kvctl {name}` leaves out {sorted(missing)}"
        assert not extra, f"README's `kvctl {name}` shows {sorted(extra)}, which kvctl lacks"


# ---------------------------------------------------------------- sessions


def _run_session(text: str, cwd: Path, env: dict[str, str],
                 timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-euo", "pipefail", "-c", text], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.netns
def test_the_engine_example_runs_against_the_netns_daemons(tmp_path: Path) -> None:
    for block in blocks_of("python"):
        name = re.match(r"# ([\w-]+\.py)", block.text)
        assert name is not None, block.text[:80]
        (tmp_path / name[1]).write_text(block.text)
    env = _environment(KVWIRE_NETNS_DIR=str(tmp_path / "netns"))
    try:
        result = _run_session(session("kvctl netns up").text, tmp_path, env, timeout=300)
    finally:
        down = subprocess.run(["kvctl", "netns", "down"], env=env, capture_output=True,
                              text=True, timeout=60)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    assert down.returncode == 0, down.stderr
    out = result.stdout
    assert "prefill: req-42 delivered, 50331648 B" in out, out
    assert "decode: req-42 landed, 50331648 B" in out, out
    consumed = [line.split() for line in out.splitlines() if line.startswith("file-1 ")]
    # request, bytes, layers, first layer s, delivered s, checksum, bytes
    assert consumed and consumed[-1][1:3] == ["6291456", "24"], out
    assert consumed[-1][-2:] == ["ok", "ok"], out
    assert not (tmp_path / "netns").exists()
    tag = f"kvw-s{zlib.crc32(str((tmp_path / 'netns').resolve()).encode()):08x}"
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert tag not in namespaces, namespaces


@pytest.mark.lab
def test_the_lab_session_and_the_deployment_sessions_run(tmp_path: Path) -> None:
    """The lab session line for line, with its own state directory; before its
    last line, the deployment sessions run as root in the decode node, whose
    /etc is its own (``make install`` installs into the checkout's venv,
    as the lab's systemd tests do: the nodes have no network to fetch from)."""
    env = _environment(KVWIRE_LAB_DIR=str(tmp_path / "lab"))
    lines = [line for line in session("kvctl lab up").text.splitlines() if line.strip()]
    assert lines[-1].split("#")[0].split() == ["kvctl", "lab", "down"]
    in_node = " ".join(f"'{part}'" for part in (
        "env", f"PATH={VENV_BIN}:/usr/sbin:/usr/bin:/sbin:/bin",
        f"PREFIX={Path(VENV_BIN).parent}"))
    deployment = [b.text for b in blocks_of("sh") if SESSIONS[b.first_command] == "lab-node"]
    try:
        for line in lines[:-1]:
            result = _run_session(line, ROOT, env, timeout=600)
            assert result.returncode == 0, f"{line}\n{result.stdout}\n{result.stderr}"
        for text in deployment:
            result = _run_session(
                f"kvctl lab exec decode -- {in_node} sh -euc {shlex.quote(text)}", ROOT, env,
                timeout=300)
            assert result.returncode == 0, f"{text}\n{result.stdout}\n{result.stderr}"
            if text.startswith("kvctl keys"):
                assert "decode-0 (receiver)" in result.stdout, result.stdout
                assert "prefill-0 (sender)" in result.stdout, result.stdout
                assert re.search(r"^ca +\S", result.stdout, re.M), result.stdout
    finally:
        down = _run_session(lines[-1], ROOT, env, timeout=300)
    assert down.returncode == 0, down.stderr
    assert "lab down" in down.stdout
    assert not (tmp_path / "lab").exists()


