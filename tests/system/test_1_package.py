"""The .deb: what apt installs, where, and what postinst did."""

from __future__ import annotations

import subprocess
from pathlib import Path

from .conftest import FIGURES
from .nspawn import SYSTEM_PATH, Container


def test_apt_pulls_the_dependencies_from_debian(ct: Container) -> None:
    assert ct.install_log is not None
    log = ct.install_log.out
    for dep in ("python3-systemd", "python3-dbus-next"):
        assert dep in log, f"apt did not install {dep}:\n{log}"
        assert ct.sh(f"dpkg-query -W -f='${{Status}}' {dep}").out == "install ok installed"


def test_files_are_where_an_operator_looks(ct: Container) -> None:
    for path in (
        "/usr/bin/providerctl",
        "/usr/lib/systemd/system-generators/providerd-generator",
        "/lib/systemd/system/provider@.socket",
        "/lib/systemd/system/provider@.service",
        "/lib/systemd/system/provider-worker@.service",
        "/usr/share/man/man1/providerctl.1.gz",
        "/usr/share/man/man5/provider.toml.5.gz",
        "/usr/share/doc/providerd/copyright",
        "/usr/share/doc/providerd/examples/demo.toml",
        "/usr/lib/python3/dist-packages/agent/__init__.py",
        "/usr/lib/python3/dist-packages/agent/_vendor/pynvml.py",
    ):
        assert ct.sh(f"test -e {path}", check=False).rc == 0, f"{path} is not installed"
    assert (
        ct.sh("test -x /usr/lib/systemd/system-generators/providerd-generator", check=False).rc == 0
    )
    assert ct.sh("test -d /etc/providerd/providers").rc == 0
    assert (
        "BSD" in ct.sh("grep -A6 'agent/_vendor/pynvml.py' /usr/share/doc/providerd/copyright").out
    )


def test_providerctl_runs_from_the_path(ct: Container) -> None:
    r = ct.sh("providerctl --help", check=False)
    assert r.rc == 0, str(r)
    for verb in ("check", "reload", "status", "serve"):
        assert verb in r.out


def test_nvml_without_a_driver_fails_cleanly(ct: Container) -> None:
    """No NVIDIA here: the vendored pynvml loads, and NVML reports a missing library, not a crash."""
    r = ct.sh(
        "python3 -c 'from agent._vendor import pynvml\n"
        'try:\n    pynvml.nvmlInit()\nexcept pynvml.NVMLError_LibraryNotFound:\n    print("no-library")\''
    )
    assert r.out.strip() == "no-library"


def test_postinst_started_the_sockets_of_existing_manifests(ct: Container) -> None:
    # tests/system/conftest.py placed /etc/providerd/providers/preinstalled.toml before apt install.
    assert (
        ct.sh("systemctl is-enabled provider@preinstalled.socket", check=False).out.strip()
        == "enabled-runtime"
    )
    assert ct.active("provider@preinstalled.socket") == "active"
    assert ct.listening(18001)
    r = ct.sh("curl -sS --max-time 30 http://127.0.0.1:18001/")
    assert '"argv"' in r.out


def test_lintian_has_no_errors_or_warnings(deb: Path) -> None:
    r = subprocess.run(
        ["lintian", "--allow-root", "-I", "--pedantic", "--fail-on", "error,warning", str(deb)],
        capture_output=True,
        text=True,
        env={"PATH": SYSTEM_PATH, "LANG": "C.UTF-8"},
    )
    tags = [line for line in r.stdout.splitlines() if line[:2] in ("E:", "W:", "I:", "P:", "X:")]
    FIGURES.append("lintian: " + ("; ".join(tags) if tags else "no tags"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert not [t for t in tags if t.startswith(("E:", "W:"))]
