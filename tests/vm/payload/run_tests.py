#!/usr/bin/python3
"""The VM tier's payload: runs inside the VM (systemd PID 1, pure cgroup v2), as root.

It installs the .deb with apt, writes manifests whose workers hit their limits, drives
them with real requests, and prints one JSON object per line, `{"check": NAME, ...}`,
to the second serial port. The host (tests/vm/test_limits.py) asserts on them; this
script only observes and never decides pass or fail.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

CI = "/usr/local/lib/providerd-ci"
PROBE = f"{CI}/probe_worker.py"
DEVICE = "/dev/ci-kmsg"  # char 1:11 (kmsg), mode 0666: outside what DevicePolicy=closed allows


T0 = time.monotonic()


def emit(check: str, **data: Any) -> None:
    print(json.dumps({"check": check, "at_s": round(time.monotonic() - T0, 1), **data}), flush=True)


def sh(cmd: str, timeout: float = 300) -> dict[str, Any]:
    p = subprocess.run(["/bin/bash", "-c", cmd], capture_output=True, text=True, timeout=timeout)
    return {"rc": p.returncode, "out": p.stdout[-6000:], "err": p.stderr[-4000:]}


def get(url: str, timeout: float = 120) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return {
                "status": r.status,
                "headers": dict(r.headers),
                "body": r.read().decode(errors="replace"),
            }
    except urllib.error.HTTPError as e:
        return {
            "status": e.code,
            "headers": dict(e.headers),
            "body": e.read().decode(errors="replace"),
        }
    except Exception as e:
        return {"status": None, "error": repr(e)}


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def manifest(port: int, args: list[str], limits: str, idle: float = 60) -> str:
    argv = ", ".join(json.dumps(a) for a in ["/usr/bin/python3", PROBE, "--port", "{port}", *args])
    return (
        f'description = "VM tier probe"\n[listen]\naddress = "127.0.0.1:{port}"\nprotocol = "http"\n'
        f'[runtime]\ncommand = [{argv}]\nready = "tcp"\nstart_timeout_s = 120\nrequest_timeout_s = 120\n'
        f"idle_timeout_s = {idle}\n[limits]\n{limits}\n"
    )


PROVIDERS = {
    # grows past memory_max while loading: the kernel OOM-kills it, held requests get the cause
    "growload": (19001, ["--alloc-mb", "400"], 'memory_max = "96M"'),
    # fine at start, grows past memory_max while serving
    "growserve": (19002, ["--alloc-mb", "16"], 'memory_max = "128M"'),
    # tries 200 threads with tasks_max = 24
    "tasks": (19003, ["--threads", "200"], "tasks_max = 24"),
    # tries to open a device the manifest does not allow
    "device": (19004, ["--open", DEVICE], 'memory_max = "256M"'),
    # holds 150 MiB: `providerctl status` must show it
    "memory": (19005, ["--alloc-mb", "150"], 'memory_max = "512M"'),
}


def unit_props(unit: str, *names: str) -> dict[str, str]:
    out = sh(f"systemctl show {unit} " + " ".join(f"-p {n}" for n in names))["out"]
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def main() -> int:
    t0 = time.monotonic()
    emit(
        "env",
        kernel=os.uname().release,
        systemd=sh("systemctl --version | head -n1")["out"].strip(),
        cgroup_fs=sh("stat -f -c %T /sys/fs/cgroup")["out"].strip(),
        controllers=Path("/sys/fs/cgroup/cgroup.controllers").read_text().split(),
        boot_s=sh("systemctl show -P ActiveEnterTimestampMonotonic multi-user.target")[
            "out"
        ].strip(),
    )
    debs = sorted(f for f in os.listdir("/ci") if f.endswith(".deb"))
    emit("install", **sh(f"apt-get install -y --no-install-recommends /ci/{debs[-1]}"))

    os.makedirs(CI, exist_ok=True)
    shutil.copy("/ci/probe_worker.py", PROBE)
    os.chmod(PROBE, 0o755)
    os.mknod(DEVICE, 0o666 | 0o020000, os.makedev(1, 11))
    os.chmod(DEVICE, 0o666)
    for slug, (port, args, limits) in PROVIDERS.items():
        with open(f"/etc/providerd/providers/{slug}.toml", "w") as f:
            f.write(manifest(port, args, limits))
    emit("reload", **sh("providerctl reload"))

    # --- memory_max while loading: three requests held, the worker OOM-killed -------
    port = PROVIDERS["growload"][0]
    with ThreadPoolExecutor(3) as pool:
        held = list(pool.map(lambda _: get(f"http://127.0.0.1:{port}/"), range(3)))
    emit(
        "oom_start",
        responses=held,
        worker=unit_props("provider-worker@growload.service", "Result", "MemoryMax", "ActiveState"),
        socket_active=sh("systemctl is-active provider@growload.socket")["out"].strip(),
        listening=listening(port),
        journal=sh(
            "journalctl -q -o cat -u provider@growload.service -u provider-worker@growload.service"
        )["out"],
        kernel_log=sh("journalctl -q -k -o cat | grep -i -m5 'oom'")["out"],
    )

    # --- memory_max while serving ---------------------------------------------------
    port = PROVIDERS["growserve"][0]
    first = get(f"http://127.0.0.1:{port}/")
    grow = get(f"http://127.0.0.1:{port}/alloc?mb=400")
    time.sleep(1)
    emit(
        "oom_serve",
        first=first,
        grow=grow,
        worker=unit_props(
            "provider-worker@growserve.service", "Result", "MemoryMax", "ActiveState"
        ),
        listening=listening(port),
        after=get(f"http://127.0.0.1:{port}/"),
        journal=sh(
            "journalctl -q -o cat -u provider@growserve.service -u provider-worker@growserve.service"
        )["out"],
    )

    # --- tasks_max -------------------------------------------------------------------
    port = PROVIDERS["tasks"][0]
    emit(
        "tasks",
        response=get(f"http://127.0.0.1:{port}/"),
        worker=unit_props("provider-worker@tasks.service", "TasksMax", "TasksCurrent"),
    )

    # --- DevicePolicy ----------------------------------------------------------------
    port = PROVIDERS["device"][0]
    fd = os.open(DEVICE, os.O_WRONLY)  # the same node, opened from outside the worker's cgroup
    os.close(fd)
    emit(
        "device",
        control="ok",
        response=get(f"http://127.0.0.1:{port}/"),
        worker=unit_props("provider-worker@device.service", "DevicePolicy", "DeviceAllow"),
    )

    # --- providerctl status shows the worker's real memory ----------------------------
    port = PROVIDERS["memory"][0]
    response = get(f"http://127.0.0.1:{port}/")
    emit(
        "memory_status",
        response=response,
        memory_current=unit_props("provider-worker@memory.service", "MemoryCurrent")[
            "MemoryCurrent"
        ],
        status_json=sh("providerctl status memory --json"),
        status_text=sh("providerctl status memory"),
    )

    # --- stopping everything is prompt (no unit waits out its stop timeout) ----------
    cursor = sh("journalctl -n0 --show-cursor -q")["out"].strip().removeprefix("-- cursor: ")
    t1 = time.monotonic()
    stop = sh("systemctl stop 'provider@*.socket' 'provider@*.service' 'provider-worker@*.service'")
    emit(
        "stop_all",
        seconds=round(time.monotonic() - t1, 1),
        rc=stop["rc"],
        journal=sh(f"journalctl -q -o short-monotonic --after-cursor='{cursor}' | tail -n 60")[
            "out"
        ],
    )
    emit("done", seconds=round(time.monotonic() - t0, 1))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as e:  # the host reports it; the VM still powers off
        emit("crash", error=repr(e))
        raise
