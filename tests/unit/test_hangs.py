"""A hung test fails with what it waited on, and the run goes on (tests/hangs.py)."""

from __future__ import annotations

import asyncio
import io
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

from ..hangs import print_tasks

REPO = Path(__file__).resolve().parents[2]


def test_the_tasks_of_a_loop_in_another_thread_are_printed_where_they_wait() -> None:
    started, release = threading.Event(), threading.Event()

    async def waiting_for_a_reply() -> None:
        started.set()
        while not release.is_set():
            await asyncio.sleep(0.01)

    async def main() -> None:
        await asyncio.create_task(waiting_for_a_reply(), name="the-reply")

    thread = threading.Thread(target=asyncio.run, args=(main(),))
    thread.start()
    try:
        assert started.wait(30)
        out = io.StringIO()
        assert print_tasks(out) == 2  # main() and the task it awaits
        text = out.getvalue()
        assert "task the-reply" in text and "waiting_for_a_reply" in text, text
    finally:
        release.set()
        thread.join(30)


def test_a_hung_asyncio_test_fails_naming_its_waiting_task_and_the_next_test_runs(
        tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(
        "from tests.hangs import pytest_timeout_cancel_timer, pytest_timeout_set_timer\n")
    (tmp_path / "test_hung.py").write_text(textwrap.dedent("""
        import asyncio
        import pytest

        async def answer_that_never_comes():
            await asyncio.Event().wait()

        @pytest.mark.timeout(7)
        def test_hangs():
            async def main():
                await asyncio.create_task(answer_that_never_comes(), name="the-answer")
            asyncio.run(main())

        def test_after():
            pass
    """))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
         str(tmp_path), str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "1 failed, 1 passed" in out, out
    assert "Timeout (>7.0s)" in out, out
    assert "near its timeout: task the-answer" in out, out
    assert "answer_that_never_comes" in out, out
