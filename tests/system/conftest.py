"""The container tier: a clean Debian 12 booted with systemd 252, providerd installed by apt.

One container serves the whole session (boot ~0.5 s, install ~5 s); tests use their
own providers so that they do not depend on each other, except the package
lifecycle tests (upgrade, removal), which run last.
"""

from __future__ import annotations

import os
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.paths import ROOT

from .nspawn import Container, installed

HERE = Path(__file__).resolve().parent
REPO = ROOT
CI_DIR = "/usr/local/lib/providerd-ci"
PROBE = f"{CI_DIR}/probe_worker.py"
MISBEHAVE = f"{CI_DIR}/misbehave.py"  # tests/workers/misbehave.py

# Figures shown at the end of the run (systemd-analyze security, timings).
FIGURES: list[str] = []


# These remove the package from the shared container: they always run last.
LAST = "test_9_package_lifecycle.py"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: Path(str(item.path)).name == LAST)  # stable: order kept otherwise


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if FIGURES:
        terminalreporter.section("providerd figures")
        for line in FIGURES:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def deb(pytestconfig: pytest.Config) -> Path:
    value = pytestconfig.getoption("--deb")
    if not value:
        pytest.fail(
            "the container tier needs --deb=dist/providerd_<version>_all.deb (make system builds it)"
        )
    path = Path(value).resolve()
    if not path.is_file():
        pytest.fail(f"{path} does not exist; run `make deb`")
    return path


@pytest.fixture(scope="session")
def base_tarball() -> Path:
    if os.geteuid() != 0:
        pytest.fail("the container tier needs root (systemd-nspawn)")
    out = subprocess.run([str(HERE / "base-rootfs.sh")], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.fail(f"cannot build the Debian 12 base tree:\n{out.stderr}")
    return Path(out.stdout.strip().splitlines()[-1])


def probe_manifest(
    port: int, *args: str, extra: str = "", environment: str = "", idle: float = 30
) -> str:
    """A manifest whose worker is probe_worker.py (it echoes argv and environment back)."""
    argv = ", ".join(f'"{a}"' for a in ["/usr/bin/python3", PROBE, "--port", "{port}", *args])
    env = f"\n[runtime.environment]\n{environment}" if environment else ""
    return (
        textwrap.dedent(
            f"""\
        description = "probe worker for the container tier"
        [listen]
        address = "127.0.0.1:{port}"
        protocol = "http"
        [runtime]
        command = [{argv}]
        ready = "tcp"
        start_timeout_s = 30
        request_timeout_s = 30
        idle_timeout_s = {idle}
        """
        )
        + env
        + ("\n" + extra if extra else "")
    )


def demo_manifest(port: int, idle: float) -> str:
    """The shipped demo manifest, on another port and with a short idle timeout."""
    text = (REPO / "examples" / "demo.toml").read_text()
    out = []
    for line in text.splitlines():
        if line.startswith("address"):
            line = f'address = "127.0.0.1:{port}"'
        elif line.startswith("idle_timeout_s"):
            line = f"idle_timeout_s = {idle}"
        out.append(line)
    return "\n".join(out) + "\n"


@pytest.fixture(scope="session")
def ct(deb: Path, base_tarball: Path) -> Iterator[Container]:
    def prepare(c: Container) -> None:
        c.copy_in(HERE / "probe_worker.py", PROBE)
        (c.root / PROBE.lstrip("/")).chmod(0o755)
        c.copy_in(REPO / "tests" / "workers" / "misbehave.py", MISBEHAVE)
        (c.root / MISBEHAVE.lstrip("/")).chmod(0o755)
        # An administrator's manifest that exists before the package: postinst must start it.
        manifests = c.root / "etc/providerd/providers"
        manifests.mkdir(parents=True, exist_ok=True)
        (manifests / "preinstalled.toml").write_text(probe_manifest(18001))
        (manifests / "preinstalled.toml").chmod(0o644)

    keep = bool(os.environ.get("PROVIDERD_KEEP_CONTAINER"))
    try:
        with installed(deb, base_tarball, f"providerd-ct-{os.getpid()}", prepare, keep) as c:
            yield c
    except RuntimeError as e:
        pytest.fail(str(e))


@pytest.fixture
def provider(ct: Container) -> Iterator[Provider]:
    """Add providers by manifest for one test; they are stopped and removed afterwards."""
    made = Provider(ct)
    yield made
    made.cleanup()


class Provider:
    def __init__(self, ct: Container) -> None:
        self.ct = ct
        self.slugs: list[str] = []

    def add(self, slug: str, manifest: str, reload: bool = True) -> None:
        self.ct.write(f"/etc/providerd/providers/{slug}.toml", manifest)
        self.slugs.append(slug)
        if reload:
            self.ct.sh("providerctl reload")

    def cleanup(self) -> None:
        for slug in self.slugs:
            self.ct.sh(f"rm -f /etc/providerd/providers/{slug}.toml", check=False)
        if self.slugs:
            self.ct.sh("providerctl reload", check=False)
            for slug in self.slugs:
                self.ct.sh(
                    f"systemctl stop provider@{slug}.socket provider@{slug}.service provider-worker@{slug}.service;"
                    f" systemctl reset-failed 'provider*@{slug}.*'",
                    check=False,
                )
