"""The whole agent on a real card, in the foreground (`providerctl serve`), with real CUDA workers.

Three providers that each need about 45% of the card: the third start retires the least
recently used idle one, never a busy one; an over-budget worker is stopped; after the
idle deadline the card's memory is back within one second; placement sets
CUDA_VISIBLE_DEVICES as chosen.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from gpu_tier import GIB, ROOT, WORKER, card, card_by_uuid, figure, skip
from support.net import free_port, wait_port
from support.net import get_json as get
from support.serve import Served, serve_env


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid)


def _state(pid: int) -> str:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("State:"):
                return line.lower()
    except OSError:
        return "zombie"
    return ""


def manifest(
    d: Path,
    slug: str,
    port: int,
    budget: int,
    alloc: int,
    idle_s: float,
    *,
    start_timeout_s: float = 60,
    runtime: str = "",
    gpu: str = "",
) -> Path:
    f = d / f"{slug}.toml"
    f.write_text(
        f"""description = "GPU tier {slug}"
[listen]
address = "127.0.0.1:{port}"
protocol = "http"
[runtime]
command = ["{{python}}", "{WORKER}", "serve", "--port", "{{port}}", "--bytes", "{alloc}"]
ready = "http:/health"
start_timeout_s = {start_timeout_s}
request_timeout_s = 60
idle_timeout_s = {idle_s}
{runtime}
[gpu]
devices = "auto"
vram_budget_gb = {budget / GIB:.3f}
enforce = "stop"
{gpu}
"""
    )
    f.chmod(0o644)
    return f


def test_three_providers_over_budget_idle_release_and_placement() -> None:
    try:
        import agent.cli.serve
        import agent.net.proxy  # noqa: F401
    except ImportError as why:
        skip(f"the foreground agent is not importable here: {why}")
    c = card()
    share = int(c.total * 0.45)
    if c.free < 2 * share + 8 * GIB:
        skip(f"GPU {c.index} has only {c.free / GIB:.0f} GiB free")
    alloc = share - int(1.5 * GIB)  # plus the CUDA context: within the budget
    tmp = Path(tempfile.mkdtemp(prefix="providerd-gpu-serve-"))
    mdir = tmp / "providers"
    mdir.mkdir(mode=0o755)
    ports = {s: free_port() for s in ("a", "b", "c", "d", "e")}
    manifests = [
        manifest(mdir, "a", ports["a"], share, alloc, 120),
        manifest(mdir, "b", ports["b"], share, alloc, 120),
        manifest(mdir, "c", ports["c"], share, alloc, 120),
        manifest(mdir, "d", ports["d"], 2 * GIB, GIB, 120),
        manifest(mdir, "e", ports["e"], 4 * GIB, 3 * GIB, 3),
    ]
    out = Path(os.environ.get("OUT", tmp))
    env = serve_env(tmp, PYTHONPATH=str(ROOT), PROVIDERD_MANIFEST_DIRS=str(mdir))
    serve = Served(manifests, env, cwd=ROOT, log_file=out / "gpu-serve.log")
    try:
        for p in ports.values():
            wait_port(p)

        # Placement: the worker sees the chosen card.
        t0 = time.monotonic()
        code, a = get(ports["a"], "/info")
        figure("serve: cold start of a (45%)", f"{time.monotonic() - t0:.2f} s")
        assert code == 200, a
        assert a["CUDA_VISIBLE_DEVICES"] == c.uuid
        assert a["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        code, b = get(ports["b"], "/info")
        assert code == 200, b

        # a is the least recently used, but busy: c's start must retire b, not a.
        slow: dict[str, Any] = {}
        t = threading.Thread(target=lambda: slow.update(r=get(ports["a"], "/slow?s=8")))
        t.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        code, cc = get(ports["c"], "/info")
        figure("serve: start of c retiring an idle provider", f"{time.monotonic() - t0:.2f} s")
        assert code == 200, cc
        assert not alive(b["pid"]), "b (idle) should have been retired"
        assert alive(a["pid"]), "a (busy) must never be retired"
        t.join()
        assert slow["r"][0] == 200, slow
        assert slow["r"][1]["pid"] == a["pid"]

        # Now c is the least recently used idle one: b's start retires c, not a.
        code, b2 = get(ports["b"], "/info")
        assert code == 200, b2
        assert not alive(cc["pid"]) and alive(a["pid"])

        status = subprocess.run(
            [sys.executable, "-m", "agent", "status", "--json"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        (out / "gpu-status.json").write_text(status.stdout)
        figure(
            "serve: providerctl status --json",
            f"exit {status.returncode}, {len(status.stdout)} bytes",
        )

        # Over budget: d grows past its 2 GiB budget and is stopped.
        code, d = get(ports["d"], "/info")
        assert code == 200, d
        t0 = time.monotonic()
        with contextlib.suppress(OSError):  # the worker may be stopped while it answers
            get(ports["d"], f"/alloc?bytes={2 * GIB}", timeout=30)
        while alive(d["pid"]) and time.monotonic() - t0 < 10:
            time.sleep(0.02)
        figure("serve: over-budget worker stopped after", f"{time.monotonic() - t0:.2f} s")
        assert not alive(d["pid"])

        # Idle deadline: e's memory is back on the card within a second of it.
        time.sleep(0.5)  # d's memory shows as freed ~0.1 s after its stop: let it settle
        code, e = get(ports["e"], "/info")
        assert code == 200, e
        done = time.monotonic()  # e's last request has ended: its idle timer runs from here
        during = card_by_uuid(c.uuid).free
        deadline = done + 3
        while card_by_uuid(c.uuid).free < during + 2 * GIB:
            if time.monotonic() > deadline + 10:
                raise AssertionError("e's memory never came back")
            time.sleep(0.01)
        back = time.monotonic() - deadline
        figure("serve: memory back after the idle deadline", f"{back:.3f} s (idle_timeout_s = 3)")
        assert -0.5 < back < 1.0
    finally:
        serve.stop(signal.SIGINT)


def test_pinned_and_priorities_decide_who_gives_way() -> None:
    """Four providers of 45% each, two fit: `pin` is pinned (and outlives its idle
    timeout), `mid` has priority 5. `low` (priority 0) may retire neither and is refused
    with both named and why; `top` (priority 9) retires `mid`, never `pin`."""
    try:
        import agent.cli.serve  # noqa: F401
    except ImportError as why:
        skip(f"the foreground agent is not importable here: {why}")
    c = card()
    share = int(c.total * 0.45)
    if c.free < 2 * share + 4 * GIB:
        skip(f"GPU {c.index} has only {c.free / GIB:.0f} GiB free")
    alloc = share - int(1.5 * GIB)
    tmp = Path(tempfile.mkdtemp(prefix="providerd-gpu-priority-"))
    mdir = tmp / "providers"
    mdir.mkdir(mode=0o755)
    ports = {s: free_port() for s in ("pin", "mid", "low", "top")}
    manifests = [
        manifest(mdir, "pin", ports["pin"], share, alloc, 1, runtime="pinned = true"),
        manifest(mdir, "mid", ports["mid"], share, alloc, 120, gpu="priority = 5"),
        manifest(mdir, "low", ports["low"], share, alloc, 120, start_timeout_s=2),
        manifest(mdir, "top", ports["top"], share, alloc, 120, gpu="priority = 9"),
    ]
    out = Path(os.environ.get("OUT", tmp))
    env = serve_env(tmp, PYTHONPATH=str(ROOT), PROVIDERD_MANIFEST_DIRS=str(mdir))
    serve = Served(manifests, env, cwd=ROOT, log_file=out / "gpu-priority.log")
    try:
        for p in ports.values():
            wait_port(p)
        code, pin = get(ports["pin"], "/info")
        assert code == 200, pin
        code, mid = get(ports["mid"], "/info")
        assert code == 200, mid
        time.sleep(1.5)  # past pin's idle timeout: pinned, so it keeps its worker
        assert alive(pin["pid"]), "a pinned provider is never released on idle"

        t0 = time.monotonic()
        code, body = get(ports["low"], "/info")
        figure("priority: refusal of a lower-priority start", f"{time.monotonic() - t0:.2f} s")
        assert code == 503, body
        kept = {h["slug"]: h.get("kept") for h in body["holders"]}
        assert kept == {"pin": "pinned", "mid": "priority 5, above 0"}, body
        assert "pin (pinned)" in body["message"] and "mid (priority 5, above 0)" in body["message"]
        assert alive(pin["pid"]) and alive(mid["pid"])

        code, top = get(ports["top"], "/info")
        assert code == 200, top
        assert not alive(mid["pid"]), "mid (priority 5) gives way to top (priority 9)"
        assert alive(pin["pid"]), "a pinned provider is never retired"
        status = subprocess.run(
            [sys.executable, "-m", "agent", "status", "--json", "pin", "top"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        doc = json.loads(status.stdout)
        by_slug = {p["slug"]: p for p in doc["providers"]}
        assert by_slug["pin"]["pinned"] is True and by_slug["pin"]["state"] == "ready"
        assert by_slug["top"]["gpu"]["priority"] == 9
    finally:
        serve.stop(signal.SIGINT)
