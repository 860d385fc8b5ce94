"""kvctl loads the modules of the command it runs, not every command's."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys

import pytest

from kvctl.cli import BUILT_IN, COMMAND_MODULES, build_parser

# What a command in its own module brings that `kvctl push` must not pay for.
HEAVY = ("aiohttp", "cryptography", "rich", "kvctl.vllm.proxy", "kvctl.keys", "kvctl.cluster",
         "kvctl.lab.cli", "kvctl.run.cli")


def _modules_after(argv: list[str]) -> set[str]:
    script = f"""
import json, sys
from kvctl.cli import main
try:
    main({argv!r})
except SystemExit:
    pass
print(json.dumps(sorted(sys.modules)))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.splitlines()[-1]))


@pytest.mark.parametrize("argv", [["push", "--help"], ["consume", "--help"],
                                  ["status", "--help"]])
def test_an_engine_command_loads_none_of_the_other_commands_modules(argv: list[str]) -> None:
    loaded = _modules_after(argv)
    assert not {name for name in loaded if name.split(".")[0] in HEAVY or name in HEAVY}


def test_a_command_in_its_own_module_loads_that_module_only() -> None:
    loaded = _modules_after(["keys", "--help"])
    assert "kvctl.keys" in loaded
    assert not {"kvctl.vllm.proxy", "kvctl.cluster", "kvctl.lab.cli"} & loaded


def test_help_and_a_mistyped_command_still_list_every_command(
        capsys: pytest.CaptureFixture[str]) -> None:
    from kvctl.cli import main

    for argv in (["--help"], ["pussh"]):
        with pytest.raises(SystemExit):
            main(argv)
        captured = capsys.readouterr()
        text = captured.out + captured.err
        for name in (*BUILT_IN, *COMMAND_MODULES):
            assert name in text, (argv, name)


def _help_of(parser: argparse.ArgumentParser, name: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        parser.parse_args([name, "--help"])
    return out.getvalue()


def test_each_command_has_the_same_options_alone_as_among_all() -> None:
    every = build_parser()
    for name in (*BUILT_IN, *COMMAND_MODULES):
        assert _help_of(build_parser(only=name), name) == _help_of(every, name)
