"""The generator's record of what the early start needs (agent.systemd.early_record): what it
holds, that the early start decides from it exactly as from the manifest, and every change
that makes it not count (the early start then validates the manifest itself)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.front import early
from agent.spec import apikeys, locations
from agent.systemd import early_record, generator
from tests.fakes.fake_bus import FakeBus
from tests.unit.test_early_start import GPU, HOST, PRIVATE, add, said, systemd
from tests.unit.test_early_start import host as host

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def generated(host: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The early start's host (test_early_start's `host`), with a generator directory.
    The tests write their files just before they generate: no window for racy files
    (`test_a_file_changed_just_before_the_snapshot_is_watched_by_no_record` keeps it)."""
    out = host / "generator"
    monkeypatch.setenv("PROVIDERD_GENERATOR_DIR", str(out))
    monkeypatch.setattr(early_record, "RACY_NS", 0)
    return out


def generate(host: Path, out: Path) -> None:
    kmsg = host / "kmsg"
    kmsg.write_text("")
    assert generator.main([str(out)], generator.Log(kmsg=str(kmsg))) == 0
    assert kmsg.read_text() == ""


def manifest(host: Path, slug: str) -> Path:
    return host / "providers" / f"{slug}.toml"


def begin(host: Path, slug: str, monkeypatch: pytest.MonkeyPatch) -> tuple[early.Early, FakeBus]:
    """The early start as the front's unit runs it (PROVIDERD_MANIFEST from its drop-in)."""
    monkeypatch.setenv("PROVIDERD_MANIFEST", str(manifest(host, slug)))
    (host / "bus").unlink(missing_ok=True)
    bus = FakeBus(host / "bus", systemd())
    got = early.begin([slug])
    bus.thread.join(5)
    return got, bus


def test_records_are_written_for_the_starts_the_front_decides(host: Path, generated: Path) -> None:
    add(host, "h", HOST)
    add(host, "g", GPU)
    add(host, "p", PRIVATE)
    generate(host, generated)
    assert sorted(os.listdir(generated / early_record.DIRECTORY)) == ["g", "h"]
    fields = early_record.read("g", str(manifest(host, "g")))
    assert fields is not None
    assert (fields["gpu"], fields["gpu_count"], fields["vram_budget_gb"]) == ("auto", "1", "4.0")
    assert fields["headroom"] == str(1024**3)  # providerd.toml's default: there is none
    h = early_record.read("h", str(manifest(host, "h")))
    assert h is not None and h["port"] == "0" and h["host"].startswith("127.")


@pytest.mark.parametrize("slug", ["h", "g"])
def test_the_record_decides_as_the_manifest_does(
    host: Path, generated: Path, monkeypatch: pytest.MonkeyPatch, slug: str
) -> None:
    add(host, slug, HOST if slug == "h" else GPU)
    generate(host, generated)
    got, bus = begin(host, slug, monkeypatch)
    assert got.start is not None and got.start.from_record, said(got)
    assert got.provider is None  # the front validates the manifest in full, after StartUnit
    assert "record" in got.start.describe()
    from_record = (got.start.env, got.start.devices, [m.member for m in bus.calls])
    if got.start.admitted is not None:
        got.start.admitted.release()
    os.unlink(early_record.record_path(slug))
    again, bus = begin(host, slug, monkeypatch)
    assert again.start is not None and not again.start.from_record
    assert again.provider is not None
    assert from_record[0]["PROVIDERD_WORKER_PORT"] == str(got.start.port)
    assert without_port(from_record[0]) == without_port(again.start.env)
    assert from_record[1:] == (again.start.devices, [m.member for m in bus.calls])


def without_port(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k != "PROVIDERD_WORKER_PORT"}


def touch(path: Path) -> None:
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1000))


def rewrite(path: Path) -> None:
    text = path.read_text()
    path.unlink()
    path.write_text(text)
    path.chmod(0o644)


CHANGES: dict[str, Callable[[Path], None]] = {
    "edited": lambda host: manifest(host, "h").write_text(HOST.replace("18242", "18249")),
    "touched": lambda host: touch(manifest(host, "h")),
    "replaced": lambda host: rewrite(manifest(host, "h")),
    "chmod": lambda host: manifest(host, "h").chmod(0o640),
    "directory": lambda host: (host / "providers" / "other.toml").write_text(""),
    "providerd.toml": lambda host: (host / "providerd.toml").write_text("[gpu]\n"),
    "record writable": lambda host: os.chmod(early_record.record_path("h"), 0o666),
    "record garbled": lambda host: Path(early_record.record_path("h")).write_text("nonsense\n"),
    "record removed": lambda host: os.unlink(early_record.record_path("h")),
    "other manifest": lambda host: os.environ.__setitem__(
        "PROVIDERD_MANIFEST", str(host / "providers" / "x.toml")
    ),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_record_counts_only_while_its_files_are_as_they_were(
    host: Path, generated: Path, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    add(host, "h", HOST)
    generate(host, generated)
    monkeypatch.setenv("PROVIDERD_MANIFEST", str(manifest(host, "h")))
    assert early_record.read("h", str(manifest(host, "h"))) is not None
    CHANGES[change](host)
    assert early_record.read("h", os.environ["PROVIDERD_MANIFEST"]) is None


def test_a_record_owned_by_someone_else_does_not_count(
    host: Path, generated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    add(host, "h", HOST)
    generate(host, generated)
    monkeypatch.setenv("PROVIDERD_TRUSTED_UID", str(os.getuid() + 1))
    if os.getuid() == 0:
        os.chown(early_record.record_path("h"), 2, 2)  # neither root nor the trusted uid
    assert early_record.read("h", str(manifest(host, "h"))) is None


def test_a_changed_manifest_is_decided_from_itself(
    host: Path, generated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    add(host, "h", HOST)
    generate(host, generated)
    add(host, "h", PRIVATE)  # now a provider systemd starts beside its front
    got, bus = begin(host, "h", monkeypatch)
    assert got.start is None and got.provider is not None
    assert [m.member for m in bus.calls] == []
    bus.server.close()


def test_a_file_changed_while_the_generator_reads_it_never_matches(
    host: Path, generated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stat is taken before the manifests are read: an edit in between makes the record
    not match, rather than describe the old content with the new file's stat."""
    add(host, "h", HOST)
    real = generator.manifests.discover_rendered

    def edit_then_read() -> object:
        touch(manifest(host, "h"))
        return real()

    monkeypatch.setattr(generator.manifests, "discover_rendered", edit_then_read)
    generate(host, generated)
    assert os.path.exists(early_record.record_path("h"))
    assert early_record.read("h", str(manifest(host, "h"))) is None


def test_a_file_changed_just_before_the_snapshot_is_watched_by_no_record(
    host: Path, generated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ "Racy clean": a rewrite of the same size within the filesystem's timestamp
    granularity of the write before it leaves the same stat. A file whose mtime or ctime
    is within RACY_NS of the snapshot gets no record; once settled, it does."""
    monkeypatch.setattr(early_record, "RACY_NS", 10**9)
    add(host, "h", HOST)
    generate(host, generated)
    assert not os.path.exists(early_record.record_path("h"))  # the manifest is just written
    old = 5 * 10**9
    for path in (manifest(host, "h"), host / "providers", host / "providerd.toml"):
        if path.exists():
            st = path.stat()
            os.utime(path, ns=(st.st_atime_ns - old, st.st_mtime_ns - old))
    generate(host, generated)
    assert not os.path.exists(early_record.record_path("h"))  # an old mtime, a new ctime
    real = time.time_ns
    monkeypatch.setattr(time, "time_ns", lambda: real() + 2 * 10**9)  # two seconds on
    generate(host, generated)
    assert early_record.read("h", str(manifest(host, "h"))) is not None


@pytest.mark.parametrize("what", ["absent", "file", "directory"])
def test_keys_on_is_apikeys_own_test(host: Path, what: str) -> None:
    path = host / "keys.toml"
    if what == "file":
        path.write_text("")
    if what == "directory":
        path.mkdir()
    assert locations.keys_on(str(path)) == apikeys.keys_on(path) == (what != "absent")


@pytest.mark.parametrize("slug", ["h", "g"])
def test_deciding_from_the_record_imports_no_validation(
    host: Path, generated: Path, monkeypatch: pytest.MonkeyPatch, slug: str
) -> None:
    """The point of the record: on the way to StartUnit, none of the manifest's validation
    (nor logging, TOML, typing, dataclasses, pathlib or tempfile) is imported; for a CPU
    provider not re either. A GPU provider's placement (on the fake cards, whose JSON
    needs re) neither, even when it has something to say: a footprint that cannot be
    read is said with the module's logger once the front's logging is set up."""
    add(host, "h", HOST)
    add(host, "g", GPU)
    generate(host, generated)
    (host / "state" / "footprints").mkdir(parents=True)
    (host / "state" / "footprints" / "g.json").write_text("{ not json")
    monkeypatch.setenv("PROVIDERD_MANIFEST", str(manifest(host, slug)))
    bus = FakeBus(host / "bus", systemd())
    code = (
        f"import sys; from agent.front import early; got = early.begin(['{slug}']); "
        "modules = sorted(sys.modules); import json; "
        "said = [(r.name, r.levelno, r.getMessage()) for r in got.records]; "
        "print(json.dumps([got.start is not None and got.start.from_record, modules, said]))"
    )
    r = subprocess.run(
        [sys.executable, "-S", "-c", code],  # -S: what site imports (an editable install's
        # finder imports pathlib and re) is not the early start's
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    bus.thread.join(5)
    decided, modules, lines = json.loads(r.stdout)
    assert decided, r.stderr
    heavy = {"agent.spec.manifest", "agent.spec.values", "agent.systemd.units", "tomllib"}
    heavy |= {"agent.spec.provider", "agent.spec.paths", "agent.spec.files", "agent.spec.sizes"}
    heavy |= {"logging", "typing", "dataclasses", "pathlib", "tempfile", "contextlib"}  # ms each
    heavy |= {"re"} if slug == "h" else set()
    assert heavy.isdisjoint(modules), sorted(heavy & set(modules))
    if slug == "g":
        assert "agent.gpu.quick" in modules  # placed, and at once
        footprint = host / "state" / "footprints" / "g.json"
        warning = ["agent.gpu.footprint", 30]
        assert [w[:2] for w in lines if str(footprint) in w[2]] == [warning], lines


@pytest.mark.parametrize(("devices", "card"), [("[1]", "GPU-b")])
def test_a_pinned_card_is_placed_from_the_record_as_from_the_manifest(
    host: Path, generated: Path, monkeypatch: pytest.MonkeyPatch, devices: str, card: str
) -> None:
    add(host, "g", GPU.replace('devices = "auto"', f"devices = {devices}"))
    generate(host, generated)
    got, _bus = begin(host, "g", monkeypatch)
    assert got.start is not None and got.start.from_record, said(got)
    assert got.start.admitted is not None
    assert got.start.admitted.placement.uuids == (card,)
    assert got.start.env["CUDA_VISIBLE_DEVICES"] == card


@pytest.mark.parametrize("why", ["keys", "backoff"])
def test_what_a_record_still_leaves_to_the_front(
    host: Path, generated: Path, monkeypatch: pytest.MonkeyPatch, why: str
) -> None:
    """API keys on and a saved backoff leave the start to the front, whatever the record
    says (as without one: tests/unit/test_early_start.py)."""
    add(host, "h", HOST)
    generate(host, generated)
    if why == "keys":
        (host / "keys.toml").write_text("")
    if why == "backoff":
        (host / "run").mkdir(exist_ok=True)
        (host / "run" / "h.backoff").write_text("{}")
    monkeypatch.setenv("PROVIDERD_MANIFEST", str(manifest(host, "h")))
    bus = FakeBus(host / "bus", systemd())
    got = early.begin(["h"])
    assert got.start is None and got.provider is None, said(got)
    assert not (host / "run" / "h" / "worker.env").exists()
    bus.thread.join(0.1)
    assert bus.calls == []  # nothing was asked of PID 1
    bus.server.close()


def with_line(text: str, table: str, line: str) -> str:
    """`text` with `line` (`key = value`) in `[table]`, in place of that key's own line."""
    key = line.split(" ")[0]
    kept = [x for x in text.splitlines(keepends=True) if not x.startswith(key + " ")]
    at = kept.index(f"[{table}]\n") + 1
    return "".join([*kept[:at], line + "\n", *kept[at:]])


@pytest.mark.parametrize(
    ("table", "line", "stale"),
    [
        ("gpu", "vram_budget_gb = 4", False),  # as recorded (an int, recorded 4.0)
        ("gpu", "vram_budget_gb = 6", True),
        ("gpu", 'devices = "auto"', False),
        ("gpu", "devices = [1]", True),
        ("gpu", "count = 2", True),
        ("gpu", "priority = 5", True),
        ("runtime", "worker_port = 9002", True),  # recorded 9001
        ("isolation", 'network = "host"', True),  # another address (and port: chosen)
    ],
)
def test_a_start_from_a_record_that_says_otherwise_than_the_loaded_manifest_is_dropped(
    host: Path,
    generated: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    table: str,
    line: str,
    stale: bool,
) -> None:
    """The front compares what the record decided from (the worker's port, its address, the
    GPU request) with the manifest it loads and validates: any difference releases the
    reservation and drops the start, which the front stops, so a stale record costs a
    restart, never a wrong port or card."""
    from agent.gpu.reservations import read_reservations
    from agent.systemd.manifests import load

    recorded = with_line(GPU, "runtime", "worker_port = 9001") + "[isolation]\n"
    add(host, "g", recorded)
    generate(host, generated)
    got, _bus = begin(host, "g", monkeypatch)
    assert got.start is not None and got.start.from_record, said(got)
    assert [r.slug for r in read_reservations(host / "run")] == ["g"]
    add(host, "g", with_line(recorded, table, line))
    assert got.stale(load("g")) is stale
    assert (got.start is None) is stale
    assert (read_reservations(host / "run") == []) is stale
    assert ("says otherwise than its manifest" in caplog.text) is stale


def test_a_record_does_not_count_once_a_weights_path_is_gone(
    host: Path, generated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manifest validated because its weights existed; deleted since, it no longer
    does: the early start neither reserves a card nor starts the model (the front's
    load() refuses the manifest, as without a record)."""
    weights = host / "weights"
    weights.mkdir()
    add(host, "g", GPU + f'[weights]\npaths = ["{weights}"]\n')
    generate(host, generated)
    assert early_record.read("g", str(manifest(host, "g"))) is not None
    weights.rmdir()
    assert early_record.read("g", str(manifest(host, "g"))) is None
    got, bus = begin(host, "g", monkeypatch)
    assert got.start is None and got.provider is None, said(got)
    assert [m.member for m in bus.calls] == []
    bus.server.close()


def test_a_record_does_not_count_on_another_cpu_count(
    host: Path, generated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CPU quota is validated against the CPU count: a record made with another count
    may describe a manifest that no longer validates."""
    add(host, "h", HOST + '[limits]\ncpu_quota = "100%"\n')
    generate(host, generated)
    assert early_record.read("h", str(manifest(host, "h"))) is not None
    more = (os.cpu_count() or 1) + 1
    monkeypatch.setattr(os, "cpu_count", lambda: more)
    assert early_record.read("h", str(manifest(host, "h"))) is None


def test_weights_paths_are_the_only_paths_validation_requires_to_exist() -> None:
    """The record names every path whose existence validation checks (`exists` lines, from
    Provider.weight_paths): a new key of that kind must be recorded too."""
    from agent.spec.keys import KEYS

    assert [(k.section, k.name) for k in KEYS if k.kind == "abspaths"] == [("weights", "paths")]


def test_providerd_toml_is_read_once_per_run(
    host: Path, generated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The router's settings and the records' GPU headroom come from one read."""
    (host / "providerd.toml").write_text("[gpu]\nheadroom_gb = 2\n")
    add(host, "g", GPU)
    real = generator.config.load
    reads: list[object] = []

    def load(path: object = None) -> object:
        reads.append(path)
        return real()

    monkeypatch.setattr(generator.config, "load", load)
    generate(host, generated)
    assert len(reads) == 1
    fields = early_record.read("g", str(manifest(host, "g")))
    assert fields is not None and fields["headroom"] == str(2 * 1024**3)
