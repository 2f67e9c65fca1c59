#!/usr/bin/python3
"""The VM tier's payload: runs inside the VM (systemd PID 1, pure cgroup v2), as root.

It installs the .deb with apt, writes manifests whose workers hit their limits and GPU
providers on two fake cards (with the kernel's real device rules), drives them with
real requests, and prints one JSON object per line, `{"check": NAME, ...}`, to the
second serial port. The host (tests/vm/test_limits.py, test_gpu.py) asserts on them;
this script only observes and never decides pass or fail.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from support.net import accepts
from support.net import fetch as get

CI = "/usr/local/lib/providerd-ci"
PROBE = f"{CI}/probe_worker.py"
DEVICE = "/dev/ci-kmsg"  # char 1:11 (kmsg), mode 0666: outside what DevicePolicy=closed allows


T0 = time.monotonic()


def emit(check: str, **data: Any) -> None:
    print(json.dumps({"check": check, "at_s": round(time.monotonic() - T0, 1), **data}), flush=True)


def sh(cmd: str, timeout: float = 300, keep: int = 6000) -> dict[str, Any]:
    p = subprocess.run(["/bin/bash", "-c", cmd], capture_output=True, text=True, timeout=timeout)
    return {"rc": p.returncode, "out": p.stdout[-keep:], "err": p.stderr[-4000:]}


# The payload disk carries tests/support beside this file.
listening = functools.partial(accepts, timeout=5)


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
    # the host network: it must not reach the other fronts on loopback
    "hostnet": (19006, ["--host", "{host}"], '[isolation]\nnetwork = "host"'),
}


# GPU providers under systemd, on two fake cards: NVML is agent.gpu.nvml.DirNvml (the
# workers write what they hold to its directory), the device nodes are real nodes of
# NVIDIA's major with no driver behind them. So opening one gives ENXIO where the
# worker's device rules allow it, and EPERM where the kernel's device cgroup refuses.
FAKE_NVML = "/var/lib/providerd-ci-gpu"
CUDA_WORKER = f"{CI}/cuda_worker.py"
GIB = 1 << 30
CARDS = [
    {"uuid": f"GPU-00000000-0000-4000-8000-00000000000{i}", "name": "Fake GPU", "total": 16 * GIB}
    for i in range(2)
]
GPU_PROVIDERS = {
    # 10 GiB budgets on 16 GiB cards: one per card, so a third start must retire one
    "gpu_a": (19011, 8 * GIB, 10, 60),
    "gpu_b": (19012, 8 * GIB, 10, 60),
    "gpu_c": (19013, 8 * GIB, 10, 60),
    # a 3 s idle timeout: the card's memory must be back within a second of the deadline
    "gpu_idle": (19014, 1 * GIB, 2, 3),
    # both cards busy: it may wait 4 s for room, then its requests are refused
    "gpu_d": (19015, 8 * GIB, 10, 60),
    # more than a card holds: refused at once
    "gpu_huge": (19016, 8 * GIB, 20, 60),
}
START_TIMEOUT_S = {"gpu_d": 4}


def gpu_manifest(slug: str, port: int, nbytes: int, budget_gib: int, idle: float) -> str:
    argv = ["/usr/bin/python3", CUDA_WORKER, "serve", "--port", "{port}", "--bytes", str(nbytes)]
    start = START_TIMEOUT_S.get(slug, 120)
    return (
        f'description = "VM tier GPU provider"\n[listen]\naddress = "127.0.0.1:{port}"\n'
        f'protocol = "http"\n[runtime]\ncommand = {json.dumps(argv)}\nready = "http:/health"\n'
        f"start_timeout_s = {start}\nrequest_timeout_s = 120\nidle_timeout_s = {idle}\n"
        f'[gpu]\ndevices = "auto"\nvram_budget_gb = {budget_gib}\nenforce = "stop"\n'
    )


def setup_fake_gpus() -> None:
    os.makedirs(f"{FAKE_NVML}/procs", exist_ok=True)
    os.chmod(f"{FAKE_NVML}/procs", 0o1777)
    # Sticky: each worker (its own user) writes its own file, and the fronts (user
    # providerd) remove those of exited workers as the directory's owner, as NVML forgets
    # an exited process; a front that could not would count them for its first 0.11 s.
    shutil.chown(f"{FAKE_NVML}/procs", "providerd", "providerd")
    Path(f"{FAKE_NVML}/cards.json").write_text(json.dumps(CARDS))
    for name, minor in (("nvidia0", 0), ("nvidia1", 1), ("nvidiactl", 255)):
        os.mknod(f"/dev/{name}", 0o666 | 0o020000, os.makedev(195, minor))
        os.chmod(f"/dev/{name}", 0o666)
    # Workers write their files; fronts, like any reader, remove those of exited workers.
    for unit in ("provider@.service", "provider-worker@.service"):
        d = Path(f"/etc/systemd/system/{unit}.d")
        d.mkdir(parents=True, exist_ok=True)
        (d / "ci-fake-gpu.conf").write_text(
            f"[Service]\nEnvironment=PROVIDERD_NVML_FAKE={FAKE_NVML}\n"
            f"ReadWritePaths={FAKE_NVML}/procs\n"
        )
    shutil.copy("/ci/cuda_worker.py", CUDA_WORKER)
    os.chmod(CUDA_WORKER, 0o755)
    for slug, (port, nbytes, budget, idle) in GPU_PROVIDERS.items():
        with open(f"/etc/providerd/providers/{slug}.toml", "w") as f:
            f.write(gpu_manifest(slug, port, nbytes, budget, idle))


@functools.cache
def fake_nvml() -> Any:
    """One reader for the whole run: it times the release delay from the exit it first saw."""
    from agent.gpu.nvml import DirNvml  # the installed package, as the fronts use it

    return DirNvml(Path(FAKE_NVML))


def card_free(uuid: str) -> int:
    return int(next(c.free for c in fake_nvml().cards() if c.uuid == uuid))


def gpu_checks() -> None:
    url = {slug: f"http://127.0.0.1:{port}" for slug, (port, *_) in GPU_PROVIDERS.items()}
    t = time.monotonic()
    a = get(f"{url['gpu_a']}/info", timeout=60)
    a_s = time.monotonic() - t
    b = get(f"{url['gpu_b']}/info")
    emit(
        "gpu_placement",
        a=a,
        b=b,
        cold_start_s=round(a_s, 2),
        allow={
            s: unit_props(f"provider-worker@{s}.service", "DeviceAllow", "DevicePolicy")
            for s in ("gpu_a", "gpu_b")
        },
        journal=sh(
            "journalctl -q -o cat -u provider@gpu_a.service -u provider-worker@gpu_a.service"
        )["out"],
    )

    # a is the least recently used but busy: c's start must retire b, never a.
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(get, f"{url['gpu_a']}/slow?s=10")
        time.sleep(2)
        t = time.monotonic()
        c = get(f"{url['gpu_c']}/info")
        c_s = time.monotonic() - t
        active = {
            s: sh(f"systemctl is-active provider-worker@{s}.service")["out"].strip()
            for s in ("gpu_a", "gpu_b", "gpu_c")
        }
        status = sh(
            f"PROVIDERD_NVML_FAKE={FAKE_NVML} providerctl status gpu_a gpu_b gpu_c --json",
            keep=60000,
        )
        a_slow = slow.result()
    emit(
        "gpu_retire",
        c=c,
        start_s=round(c_s, 2),
        active=active,
        slow=a_slow,
        status=status,
        journal=sh("journalctl -q -o cat -u provider@gpu_b.service -u provider@gpu_c.service")[
            "out"
        ],
    )

    # No room: a and c both busy, so d waits its 4 s start timeout and is refused with
    # the holders named; a provider larger than any card is refused at once.
    # The busy requests outlast d's whole refusal (d_s < 30 s allowed below): on a loaded
    # host a cold front in the emulated VM takes many seconds, and with 10 s requests the
    # holders were rightly retired once they were done, so d was admitted.
    with ThreadPoolExecutor(2) as pool:
        busy = [pool.submit(get, f"{url[s]}/slow?s=25") for s in ("gpu_a", "gpu_c")]
        time.sleep(2)
        t = time.monotonic()
        d = get(f"{url['gpu_d']}/info", timeout=60)
        d_s = time.monotonic() - t
        t = time.monotonic()
        huge = get(f"{url['gpu_huge']}/info", timeout=60)
        huge_s = time.monotonic() - t
        served = [f.result() for f in busy]
    emit(
        "gpu_refused",
        d=d,
        d_s=round(d_s, 2),
        huge=huge,
        huge_s=round(huge_s, 2),
        busy=served,
        worker=sh("systemctl is-active provider-worker@gpu_d.service")["out"].strip(),
        journal=sh(
            "journalctl -q -o short-monotonic -u 'provider@gpu_*.service' "
            "-u 'provider-worker@gpu_*.service' | tail -n 120"
        )["out"],
    )

    # Over budget: c grows past its 10 GiB and is stopped by its front.
    t = time.monotonic()
    grow = get(f"{url['gpu_c']}/alloc?bytes={4 * GIB}", timeout=30)
    state = ""
    while time.monotonic() - t < 30:
        state = sh("systemctl is-active provider-worker@gpu_c.service")["out"].strip()
        if state in ("inactive", "failed"):
            break
        time.sleep(0.1)
    emit(
        "gpu_over_budget",
        grow=grow,
        state=state,
        stopped_after_s=round(time.monotonic() - t, 2),
        journal=sh("journalctl -q -o cat -u provider@gpu_c.service")["out"],
    )

    # Idle deadline: the card's memory is back within a second of it.
    fake_nvml().cards()  # this reader has now seen every exited worker so far …
    time.sleep(0.5)  # … and, as NVML would, no longer counts their memory
    idle = get(f"{url['gpu_idle']}/info")
    done = time.monotonic()  # its last request has ended: the idle timer runs from here
    uuid = (idle.get("body") and json.loads(idle["body"]).get("CUDA_VISIBLE_DEVICES")) or ""
    back = None
    if idle["status"] == 200:
        during = card_free(uuid)
        while time.monotonic() < done + 3 + 30:
            if card_free(uuid) >= during + GIB:
                back = round(time.monotonic() - (done + 3), 3)
                break
            time.sleep(0.01)
    emit(
        "gpu_idle",
        idle=idle,
        back_after_deadline_s=back,
        worker=sh("systemctl is-active provider-worker@gpu_idle.service")["out"].strip(),
        journal=sh("journalctl -q -o cat -u provider@gpu_idle.service")["out"],
    )


def unit_props(unit: str, *names: str) -> dict[str, str]:
    out = sh(f"systemctl show {unit} " + " ".join(f"-p {n}" for n in names))["out"]
    props: dict[str, str] = {}
    for key, _, value in (line.partition("=") for line in out.splitlines() if "=" in line):
        props[key] = f"{props[key]}; {value}" if key in props else value  # DeviceAllow= repeats
    return props


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
    setup_fake_gpus()
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

    # --- a host-network worker: its own loopback address, no other -------------------
    port = PROVIDERS["hostnet"][0]
    served = get(f"http://127.0.0.1:{port}/")
    own = ""
    if served.get("status") == 200:
        own = json.loads(served["body"])["env"].get("PROVIDERD_WORKER_HOST", "")
    targets = [f"127.0.0.1:{PROVIDERS['memory'][0]}", f"127.0.0.1:{PROVIDERS['tasks'][0]}"]
    emit(
        "hostnet",
        served=served,
        own=own,
        reach={t: get(f"http://127.0.0.1:{port}/connect?path={t}") for t in targets},
        worker=unit_props("provider-worker@hostnet.service", "IPAddressDeny", "IPAddressAllow"),
    )

    # --- GPU providers: placement, device rules, retirement, budget, idle release ---
    gpu_checks()

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
