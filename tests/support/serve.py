"""`providerctl serve` as a subprocess: the foreground agent with its own runtime and
state directories, its log read line by line, and `providerctl` run against it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO


def serve_env(tmp: Path, **extra: str) -> dict[str, str]:
    """The environment of a foreground agent whose runtime and state live under `tmp`, and
    which trusts manifests owned by the test's own user."""
    return {
        **os.environ,
        "PROVIDERD_RUNTIME_DIR": str(tmp / "run"),
        "PROVIDERD_STATE_DIR": str(tmp / "state"),
        "PROVIDERD_TRUSTED_UID": str(os.getuid()),
        "PYTHONUNBUFFERED": "1",
        **extra,
    }


def write_manifests(directory: Path, manifests: dict[str, str]) -> Path:
    """`slug.toml` files in a directory, with the modes the ownership check accepts."""
    directory.mkdir(mode=0o755, parents=True, exist_ok=True)
    directory.chmod(0o755)
    for slug, text in manifests.items():
        path = directory / f"{slug}.toml"
        path.write_text(text)
        path.chmod(0o644)
    return directory


class Served:
    """A running `providerctl serve PATH...`. Its log is read line by line (`lines`), and
    with `log_file` also copied there."""

    def __init__(
        self,
        paths: list[Path],
        env: dict[str, str],
        prefix: tuple[str, ...] = (),
        cwd: Path | None = None,
        log_file: Path | None = None,
    ) -> None:
        self.runtime = Path(env["PROVIDERD_RUNTIME_DIR"])
        self.env = env
        self.lines: list[str] = []
        self._copy: IO[str] | None = log_file.open("w") if log_file else None
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "agent", "serve", *map(str, paths)],
            env=env,
            cwd=cwd,
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))
            if self._copy is not None:
                self._copy.write(line)
                self._copy.flush()

    @property
    def log(self) -> str:
        return "\n".join(self.lines)

    def count(self, text: str) -> int:
        return sum(text in line for line in self.lines)

    def wait_log(self, text: str, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.count(text):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        raise AssertionError(f"no log line with {text!r} within {timeout} s:\n{self.log}")

    def ctl(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """`providerctl ARGS...` against this agent's runtime directory."""
        env = {**os.environ, "PROVIDERD_RUNTIME_DIR": str(self.runtime)}
        return subprocess.run(
            [sys.executable, "-m", "agent", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> None:
        """Signal it, wait, and kill its process group if it does not exit in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._reader.join(5)
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        if self._copy is not None:
            self._copy.close()
