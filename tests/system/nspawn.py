"""A booted Debian 12 container (systemd-nspawn, systemd 252 as its PID 1) for tests.

The container is booted with its own network namespace (`--private-network`), so
that `PrivateNetwork=` units can bring their loopback up; commands run inside it
with `nsenter` into all of its namespaces, curl included. It is not registered with
machined (the host has no systemd), and is told apart by a unique machine name.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

SYSTEM_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass
class Result:
    cmd: str
    rc: int
    out: str
    err: str

    def __str__(self) -> str:
        return f"$ {self.cmd}\n(exit {self.rc})\n{self.out}{self.err}"


class CommandFailed(AssertionError):
    pass


class Container:
    def __init__(self, workdir: Path, name: str) -> None:
        self.workdir = workdir
        self.root = workdir / "root"
        self.name = name
        self.console = workdir / "console.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self.leader = 0
        self.install_log: Result | None = None

    # --- life cycle ---------------------------------------------------------------

    def unpack(self, tarball: Path) -> None:
        self.root.mkdir(parents=True)
        subprocess.run(
            ["tar", "-C", str(self.root), "--numeric-owner", "--zstd", "-xf", str(tarball)],
            check=True,
        )

    def run_unbooted(self, script: str, timeout: float = 300) -> Result:
        """Run a script in the tree before boot, with the host's network (for apt downloads)."""
        cmd = [
            "systemd-nspawn", "-q", "-D", str(self.root), "-M", f"{self.name}-prep",
            "--register=no", "--keep-unit", "--pipe", "-E", f"PATH={SYSTEM_PATH}",
            "-E", "DEBIAN_FRONTEND=noninteractive", "/bin/bash", "-euo", "pipefail", "-c", script,
        ]  # fmt: skip
        p = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
        return Result(script, p.returncode, p.stdout, p.stderr)

    def boot(self, timeout: float = 60) -> None:
        cmd = [
            "systemd-nspawn", "-q", "-D", str(self.root), "-M", self.name, "--boot",
            "--register=no", "--keep-unit", "--private-network", "--console=read-only",
        ]  # fmt: skip
        with self.console.open("wb") as log:
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while not self.leader:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"systemd-nspawn exited with {self._proc.returncode}:\n{self.console_tail()}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"container {self.name} did not start:\n{self.console_tail()}")
            self.leader = self._find_leader()
            time.sleep(0.05)
        while True:
            state = self.sh("systemctl is-system-running", check=False).out.strip()
            if state in ("running", "degraded"):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"container {self.name} is {state!r} after {timeout} s:\n{self.console_tail()}"
                )
            time.sleep(0.1)

    def _find_leader(self) -> int:
        """The container's PID 1, as seen from the host: a descendant of nspawn whose NSpid ends in 1."""
        assert self._proc is not None
        todo = [self._proc.pid]
        while todo:
            pid = todo.pop()
            try:
                children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                try:
                    status = Path(f"/proc/{child}/status").read_text()
                except OSError:
                    continue
                nspid = next(
                    (line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")),
                    [],
                )
                if len(nspid) > 1 and nspid[-1] == "1":
                    return child
                todo.append(child)
        return 0

    def poweroff(self, timeout: float = 30) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None and self.leader:
            self.sh("systemctl poweroff --no-block", check=False, timeout=10)
            try:
                self._proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait(timeout=10)
        self._proc = None
        self.leader = 0

    def remove(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)

    def console_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.console.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    # --- commands -----------------------------------------------------------------

    def sh(
        self, script: str, check: bool = True, timeout: float = 120, input: str | None = None
    ) -> Result:
        """Run a bash script inside the booted container, as root, in all its namespaces."""
        assert self.leader, "container is not booted"
        cmd = [
            "nsenter", "-t", str(self.leader), "-a", "--",
            "/usr/bin/env", "-i", f"PATH={SYSTEM_PATH}", "LANG=C.UTF-8", "SYSTEMD_PAGER=", "SYSTEMD_COLORS=0",
            "/bin/bash", "-o", "pipefail", "-c", script,
        ]  # fmt: skip
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, input=input)
        except subprocess.TimeoutExpired as e:
            raise CommandFailed(
                f"$ {script}\ntimed out after {timeout} s\n{e.stdout or ''}{e.stderr or ''}"
            ) from e
        r = Result(script, p.returncode, p.stdout, p.stderr)
        if check and r.rc != 0:
            raise CommandFailed(str(r))
        return r

    def write(self, path: str, text: str, mode: int = 0o644) -> None:
        """Write a file inside the container (as root)."""
        self.sh(
            f"install -d -m 0755 {shlex.quote(os.path.dirname(path))} && cat > {shlex.quote(path)} "
            f"&& chmod {mode:o} {shlex.quote(path)}",
            input=text,
        )

    def copy_in(self, src: Path, dest: str) -> None:
        """Copy a host file into the tree (works before and after boot: the tree is a directory)."""
        target = self.root / dest.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)

    # --- systemd helpers ------------------------------------------------------------

    def cursor(self) -> str:
        out = self.sh("journalctl -n 0 --show-cursor -q", check=False).out
        for line in out.splitlines():
            if line.startswith("-- cursor: "):
                return line.removeprefix("-- cursor: ").strip()
        return ""

    def journal(self, args: str = "", since: str = "") -> str:
        after = f"--after-cursor={shlex.quote(since)}" if since else ""
        return self.sh(f"journalctl -q --no-pager -o cat {after} {args}", check=False).out

    def prop(self, unit: str, name: str) -> str:
        return self.sh(f"systemctl show -P {name} {shlex.quote(unit)}", check=False).out.strip()

    def active(self, unit: str) -> str:
        return self.sh(f"systemctl is-active {shlex.quote(unit)}", check=False).out.strip()

    def wait_for(self, script: str, timeout: float = 30, interval: float = 0.2) -> Result:
        """Run `script` until it exits 0; the last result on timeout raises."""
        deadline = time.monotonic() + timeout
        while True:
            r = self.sh(script, check=False)
            if r.rc == 0:
                return r
            if time.monotonic() > deadline:
                raise CommandFailed(f"not true after {timeout} s:\n{r}")
            time.sleep(interval)

    def listening(self, port: int) -> bool:
        return self.sh(f"ss -Hltn 'sport = :{port}' | grep -q .", check=False).rc == 0


def base_tarball() -> Path:
    """The cached Debian 12 base tree (built on first use by base-rootfs.sh)."""
    script = Path(__file__).resolve().parent / "base-rootfs.sh"
    out = subprocess.run([str(script)], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"cannot build the Debian 12 base tree:\n{out.stderr}")
    return Path(out.stdout.strip().splitlines()[-1])


@contextmanager
def installed(
    deb: Path,
    tarball: Path,
    name: str,
    prepare: Callable[[Container], None] = lambda _c: None,
    keep: bool = False,
) -> Iterator[Container]:
    """A booted container with `deb` installed by apt; `prepare(c)` runs on the tree before
    boot (copy files in, write manifests). Powered off and removed afterwards unless `keep`."""
    c = Container(Path(f"/var/tmp/{name}"), name)
    try:
        c.unpack(tarball)
        c.copy_in(deb, f"/root/{deb.name}")
        # The container has no network of its own once booted: fetch the package's
        # dependencies from Debian now, so that `apt install` below resolves them offline.
        r = c.run_unbooted(
            "apt-get update -qq && apt-get install -y -qq --download-only --no-install-recommends "
            f"/root/{deb.name}"
        )
        if r.rc != 0:
            raise RuntimeError(f"cannot download the .deb's dependencies:\n{r}")
        prepare(c)
        c.boot()
        install = c.sh(
            f"apt-get install -y --no-install-recommends /root/{deb.name}", check=False, timeout=300
        )
        c.install_log = install
        if install.rc != 0:
            raise RuntimeError(f"apt install of the .deb failed:\n{install}")
        yield c
    finally:
        c.poweroff()
        if not keep:
            c.remove()
