"""ProcessWorker (foreground mode) with a real child process: what a cancelled start leaves."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from agent.worker.control import ProcessWorker


def test_a_cancelled_start_leaves_no_process_and_no_credential_copy(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    worker = ProcessWorker(
        "cred",
        ["sleep", "60"],  # never says READY=1: the start waits until it is cancelled
        environment={},
        working_directory=None,
        start_timeout_s=60,
        stop_timeout_s=2,
        log=lambda _line: None,
        credentials=[("HF_TOKEN", str(token))],
    )

    async def go() -> tuple[str, int]:
        start = asyncio.create_task(worker.start({}, None))
        async with asyncio.timeout(5):
            while worker.proc is None or worker.credentials_dir is None:
                await asyncio.sleep(0.01)
        copy = worker.credentials_dir
        assert (Path(copy) / "HF_TOKEN").read_text() == "s3cret\n"
        pid = worker.proc.pid
        start.cancel()
        with pytest.raises(asyncio.CancelledError):
            await start
        return copy, pid

    copy, pid = asyncio.run(go())
    assert not os.path.exists(copy)
    assert worker.credentials_dir is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # gone, and reaped
