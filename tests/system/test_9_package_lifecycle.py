"""Upgrade, removal and purge of the installed package. Runs last: it removes providerd."""

from __future__ import annotations

import subprocess
from pathlib import Path

from .conftest import REPO, probe_manifest
from .nspawn import SYSTEM_PATH, Container, Result

PORT = 18090
UPGRADE_VERSION = "0.1.0+upgrade1"
# The last package whose fronts ran as root, and a version below this one's.
ROOT_FRONT_COMMIT = "ebfb2d6"
ROOT_FRONT_VERSION = "0.1.0~rootfront1"
ROOT_PORT = 18091

PROBE_LOOP = r"""
import os, socket, sys, time
port, stop = int(sys.argv[1]), sys.argv[2]
ok = failed = 0
errors = []
while not os.path.exists(stop):
    s = socket.socket()
    s.settimeout(5)
    try:
        s.connect(("127.0.0.1", port))
        ok += 1
    except OSError as e:
        failed += 1
        errors.append(repr(e))
    finally:
        s.close()
    time.sleep(0.02)
print(ok, failed, errors[:5])
"""


def build_root_front_package(out: Path) -> Path:
    """The package as it was when fronts ran as root, built from that commit's tree."""
    tree = out / "tree"
    tree.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", ROOT_FRONT_COMMIT], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    # build-deb.sh copies what git lists: an index of the extracted tree is enough.
    subprocess.run(["git", "init", "-q", str(tree)], check=True)
    subprocess.run(["git", "-C", str(tree), "add", "-A"], check=True)
    r = subprocess.run(
        [str(tree / "packaging" / "build-deb.sh"), str(out), ROOT_FRONT_VERSION],
        capture_output=True, text=True, env={"PATH": SYSTEM_PATH, "HOME": "/root"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    return Path(r.stdout.strip().splitlines()[-1])


def connections_during(ct: Container, port: int, script: str) -> tuple[Result, int, int, str]:
    """Run `script` while a loop connects to `port` every 20 ms: its result, and how
    many connections were accepted and refused meanwhile."""
    ct.write("/root/probe_loop.py", PROBE_LOOP)
    ct.sh(
        f"rm -f /root/stop /root/probe_loop.out; "
        f"nohup python3 /root/probe_loop.py {port} /root/stop >/root/probe_loop.out 2>&1 &"
    )
    r = ct.sh(script, check=False, timeout=300)
    ct.sh("touch /root/stop")
    ct.wait_for("test -s /root/probe_loop.out", timeout=15)
    ok, failed, *errors = ct.sh("cat /root/probe_loop.out").out.split(maxsplit=2)
    return r, int(ok), int(failed), " ".join(errors)


def test_upgrade_from_root_fronts_keeps_every_port_open(
    ct: Container, deb: Path, tmp_path: Path
) -> None:
    old = build_root_front_package(tmp_path)
    ct.copy_in(old, f"/root/{old.name}")
    r = ct.sh(f"apt-get install -y --allow-downgrades /root/{old.name}", check=False, timeout=300)
    assert r.rc == 0, str(r)
    # A host that never had this package: no providerd user yet.
    ct.sh("userdel providerd; groupdel providerd-clients; true")
    assert ct.sh("id providerd", check=False).rc != 0

    ct.write("/etc/providerd/providers/rootfront.toml", probe_manifest(ROOT_PORT, idle=300))
    ct.sh("providerctl reload")
    assert '"argv"' in ct.sh(f"curl -sS --max-time 60 http://127.0.0.1:{ROOT_PORT}/").out
    front_before = ct.prop("provider@rootfront.service", "MainPID")
    assert ct.sh(f"stat -c %u /proc/{front_before}").out.strip() == "0", "the old front is root's"
    socket_since = ct.prop("provider@rootfront.socket", "ActiveEnterTimestampMonotonic")

    up, ok, failed, errors = connections_during(
        ct, ROOT_PORT, f"apt-get install -y --no-install-recommends /root/{deb.name}"
    )
    assert up.rc == 0, str(up)
    assert failed == 0 and ok > 10, f"{ok} accepted, {failed} refused during the upgrade: {errors}"
    assert ct.prop("provider@rootfront.socket", "ActiveEnterTimestampMonotonic") == socket_since
    ct.wait_for("systemctl is-active -q provider@rootfront.service", timeout=15)
    front_after = ct.prop("provider@rootfront.service", "MainPID")
    assert front_after != front_before, "the running front was not restarted"
    assert ct.sh(f"stat -c %U /proc/{front_after}").out.strip() == "providerd"
    assert '"argv"' in ct.sh(f"curl -sS --max-time 60 http://127.0.0.1:{ROOT_PORT}/").out
    ct.sh("rm -f /etc/providerd/providers/rootfront.toml && providerctl reload")


def test_upgrade_keeps_every_port_open_and_restarts_fronts(ct: Container, tmp_path: Path) -> None:
    r = subprocess.run(
        [str(REPO / "packaging" / "build-deb.sh"), str(tmp_path), UPGRADE_VERSION],
        capture_output=True, text=True, env={"PATH": SYSTEM_PATH, "HOME": "/root"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    newer = Path(r.stdout.strip().splitlines()[-1])
    ct.copy_in(newer, f"/root/{newer.name}")

    ct.write("/etc/providerd/providers/kept.toml", probe_manifest(PORT, idle=300))
    ct.sh("providerctl reload")
    assert '"argv"' in ct.sh(f"curl -sS --max-time 60 http://127.0.0.1:{PORT}/").out
    front_before = ct.prop("provider@kept.service", "MainPID")
    socket_since = ct.prop("provider@kept.socket", "ActiveEnterTimestampMonotonic")
    assert front_before not in ("", "0")

    ct.write("/root/probe_loop.py", PROBE_LOOP)
    ct.sh(
        f"rm -f /root/stop; nohup python3 /root/probe_loop.py {PORT} /root/stop >/root/probe_loop.out 2>&1 &"
    )
    up = ct.sh(
        f"apt-get install -y --no-install-recommends /root/{newer.name}", check=False, timeout=300
    )
    ct.sh("touch /root/stop")
    ct.wait_for("test -s /root/probe_loop.out", timeout=15)
    ok, failed, *errors = ct.sh("cat /root/probe_loop.out").out.split(maxsplit=2)
    assert up.rc == 0, str(up)
    assert ct.sh("dpkg-query -W -f='${Version}' providerd").out == UPGRADE_VERSION
    assert int(failed) == 0 and int(ok) > 10, (
        f"{ok} connections accepted, {failed} refused during the upgrade: {errors}"
    )
    assert ct.prop("provider@kept.socket", "ActiveEnterTimestampMonotonic") == socket_since, (
        "the socket was restarted"
    )
    ct.wait_for("systemctl is-active -q provider@kept.service", timeout=15)
    assert ct.prop("provider@kept.service", "MainPID") != front_before, (
        "the running front was not restarted"
    )
    assert '"argv"' in ct.sh(f"curl -sS --max-time 60 http://127.0.0.1:{PORT}/").out


def test_remove_stops_every_provider(ct: Container) -> None:
    assert ct.listening(PORT)
    r = ct.sh("apt-get remove -y providerd", check=False, timeout=300)
    assert r.rc == 0, str(r)
    for unit in ("provider@kept.socket", "provider@kept.service", "provider-worker@kept.service"):
        assert ct.active(unit) in ("inactive", "unknown"), unit
    assert not ct.listening(PORT)
    assert ct.sh("pgrep -f 'agent\\.(front|worker)|probe_worker'", check=False).rc == 1
    assert ct.sh("ls /run/systemd/generator/ | grep -q provider", check=False).rc == 1, (
        "generated units are left"
    )
    assert ct.sh("test -e /usr/bin/providerctl", check=False).rc == 1
    # The administrator's manifests stay.
    assert ct.sh("test -f /etc/providerd/providers/kept.toml", check=False).rc == 0


def test_purge_removes_the_state(ct: Container) -> None:
    ct.sh(
        "mkdir -p /var/lib/providerd /run/providerd/kept && touch /var/lib/providerd/footprints.json"
    )
    r = ct.sh("apt-get purge -y providerd", check=False, timeout=300)
    assert r.rc == 0, str(r)
    assert ct.sh("test -e /var/lib/providerd || test -e /run/providerd", check=False).rc == 1
    status = ct.sh("dpkg-query -W -f='${Status}' providerd 2>/dev/null", check=False).out
    assert "installed" not in status.replace("not-installed", ""), status
