"""What a daemon loads before it serves: nothing it does not use.

On the lab's emulated nodes every module costs seconds (a daemon spent 7 s
importing before its first line of its own), and so does each restart of a
real daemon under systemd, at a host's speed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

# Installed beside the daemons wherever kvctl's extra is, used by none of them.
NOT_FOR_DAEMONS = ("rich", "numpy", "matplotlib", "aiohttp", "safetensors", "opentelemetry")


def _run(script: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout.splitlines()[-1]))


def test_a_daemon_loads_none_of_kvctls_libraries() -> None:
    found = _run("""
import json, sys
import kvwired.cli, kvwired.receiver, kvwired.sender
print(json.dumps({"loaded": sorted({m.split(".")[0] for m in sys.modules})}))
""")
    loaded = set(found["loaded"])
    assert "structlog" in loaded
    assert not loaded & set(NOT_FOR_DAEMONS), loaded & set(NOT_FOR_DAEMONS)


def test_structlog_comes_without_rich_and_rich_stays_importable() -> None:
    # structlog would import rich for console tracebacks kvwire never shows
    # (kvwired.logs formats exceptions itself); kvctl's progress bars still
    # import rich afterwards.
    found = _run("""
import json
import kvwired
import structlog.dev, structlog.tracebacks
import rich.console
print(json.dumps({"dev": structlog.dev.rich is None,
                  "tracebacks": structlog.tracebacks.rich is None,
                  "console": rich.console.Console.__name__}))
""")
    assert found == {"dev": True, "tracebacks": True, "console": "Console"}
