"""What the front's early start imports on the way to the worker's StartUnit, and what that
costs: `python3 -X importtime` of `agent.front.early.begin()` for a CPU provider whose start
the front decides (network = "host") and for a GPU provider (`[gpu]`, on the fake cards of
agent.gpu.nvml.DirNvml), each decided from the generator's record as in the installed
package, against a bus made of dbus-next's marshalling (tests/fakes/fake_bus.py).

Each run is a fresh interpreter (`-S`: what site imports is not the early start's); the
figures are medians over the runs of the imports' own times, summed per group of modules,
and the time begin() took to StartUnit's reply (its own stamp).

    python3 bench/bench_cold_imports.py [--runs N] [--no-write]

Writes bench/results/cold_imports.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agent.systemd import early_record, generator  # noqa: E402
from tests.fakes.fake_bus import FakeBus  # noqa: E402
from tests.unit.test_early_start import GPU, HOST, systemd  # noqa: E402

RESULTS = REPO / "bench" / "results" / "cold_imports.txt"
PROVIDERS = {"cpu": ("h", HOST), "gpu": ("g", GPU)}
MARK = "early-start-begins"
CODE = (
    f"import sys; sys.stderr.write('{MARK}\\n'); from agent.front import early; "
    "got = early.begin([sys.argv[1]]); s = got.start; "
    "print(s.took_ms if s is not None and s.from_record else -1)"
)
GROUPS = (
    ("logging", ("logging",)),
    ("agent.spec", ("agent.spec",)),
    ("agent.gpu", ("agent.gpu",)),
    ("typing", ("typing",)),
    ("collections", ("collections", "_collections_abc")),
    ("dataclasses", ("dataclasses", "inspect", "dis", "ast", "copy")),
    ("pathlib", ("pathlib", "fnmatch", "ntpath", "urllib")),
    ("json", ("json",)),
    ("re", ("re", "sre_", "_sre")),
)


def group_of(module: str) -> str:
    for name, prefixes in GROUPS:
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return name
    return module.split(".")[0] if not module.startswith("agent.") else module


def host(root: Path) -> dict[str, str]:
    manifests = root / "providers"
    manifests.mkdir(mode=0o755)
    manifests.chmod(0o755)
    (root / "gpus").mkdir()
    cards = [{"uuid": "GPU-a", "total": 16 << 30}, {"uuid": "GPU-b", "total": 16 << 30}]
    (root / "gpus" / "cards.json").write_text(json.dumps(cards))
    env = {
        "PROVIDERD_MANIFEST_DIRS": str(manifests),
        "PROVIDERD_RUNTIME_DIR": str(root / "run"),
        "PROVIDERD_STATE_DIR": str(root / "state"),
        "PROVIDERD_CONFIG": str(root / "providerd.toml"),
        "PROVIDERD_KEYS": str(root / "keys.toml"),
        "PROVIDERD_TRUSTED_UID": str(os.getuid()),
        "PROVIDERD_NVML_FAKE": str(root / "gpus"),
        "PROVIDERD_GENERATOR_DIR": str(root / "generator"),
        "DBUS_SYSTEM_BUS_ADDRESS": f"unix:path={root / 'bus'}",
    }
    os.environ.update(env)
    old = time.time() - 10  # settled files: the generator writes records for them
    for _kind, (slug, text) in PROVIDERS.items():
        f = manifests / f"{slug}.toml"
        f.write_text(text)
        f.chmod(0o644)
        os.utime(f, (old, old))
    os.utime(manifests, (old, old))
    time.sleep(early_record.RACY_NS / 1e9 + 0.1)  # ctimes settle too
    kmsg = root / "kmsg"
    kmsg.write_text("")
    if generator.main([str(root / "generator")], generator.Log(kmsg=str(kmsg))) != 0:
        raise SystemExit(f"bench_cold_imports: the generator failed: {kmsg.read_text()}")
    return env


def one(root: Path, slug: str) -> tuple[dict[str, float], float]:
    """One fresh interpreter's early start: µs of imports per group, and begin()'s ms."""
    (root / "bus").unlink(missing_ok=True)
    for f in (root / "run").glob("*/gpu.json"):
        f.unlink()  # the last run's reservation: its front is gone, but its PID may be reused
    bus = FakeBus(root / "bus", systemd())
    env = dict(os.environ, PROVIDERD_MANIFEST=str(root / "providers" / f"{slug}.toml"))
    env["PYTHONPATH"] = str(REPO)
    r = subprocess.run(
        [sys.executable, "-S", "-X", "importtime", "-c", CODE, slug],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    bus.thread.join(5)
    took = float(r.stdout.strip() or -1)
    if took < 0:
        raise SystemExit(f"bench_cold_imports: {slug} was not decided from its record:\n{r.stderr}")
    groups: dict[str, float] = {}
    lines = r.stderr.split(MARK + "\n", 1)[1].splitlines()
    for line in lines:
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        own, _cumulative, name = line[len("import time:") :].split("|")
        g = group_of(name.strip())
        groups[g] = groups.get(g, 0.0) + float(own)
    return groups, took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args()
    out = [
        f"The early start's imports on the way to StartUnit ({sys.executable} -S -X importtime, "
        f"Python {sys.version.split()[0]}), medians of {args.runs} fresh interpreters, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
    ]
    with tempfile.TemporaryDirectory(prefix="providerd-imports-") as tmp:
        root = Path(tmp)
        host(root)
        results: dict[str, list[tuple[dict[str, float], float]]] = {k: [] for k in PROVIDERS}
        for _ in range(args.runs):
            for kind, (slug, _text) in PROVIDERS.items():  # interleaved
                results[kind].append(one(root, slug))
    totals: dict[str, float] = {}
    for kind, runs in results.items():
        names = sorted({g for groups, _ in runs for g in groups})
        medians = {g: statistics.median(groups.get(g, 0.0) for groups, _ in runs) for g in names}
        total = statistics.median(sum(groups.values()) for groups, _ in runs)
        took = statistics.median(t for _, t in runs)
        totals[kind] = total
        out.append(
            f"{kind}: imports {total / 1000:.1f} ms in all, begin() to StartUnit's reply "
            f"{took:.1f} ms; the groups of 0.3 ms or more:"
        )
        big = sorted(((v, g) for g, v in medians.items() if v >= 300), reverse=True)
        out += [f"  {g:<32} {v / 1000:>6.1f} ms" for v, g in big]
        out.append(f"  modules: {', '.join(names)}")
    out.append(f"gpu - cpu imports: {(totals['gpu'] - totals['cpu']) / 1000:+.1f} ms")
    text = "\n".join(out) + "\n"
    print(text, end="")
    if not args.no_write:
        RESULTS.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
