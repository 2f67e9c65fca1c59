"""The generator's promises: skip bad manifests and go on, log each problem,
exit 0, write atomically, and write exactly what `render` says."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
from cases.harness import write

from agent.spec import manifest
from agent.systemd import generator, units

GOOD = '[listen]\naddress = "127.0.0.1:{port}"\n[runtime]\ncommand = ["/opt/m", "--port", "{{port}}"]\n'


@pytest.fixture(autouse=True)
def trusted_self(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROVIDERD_TRUSTED_UID", str(os.getuid()))


def stderr_log() -> tuple[generator.Log, io.StringIO]:
    buf = io.StringIO()
    return generator.Log(kmsg="/nonexistent/kmsg", fallback=buf), buf


def tree(root: Path) -> dict[str, str]:
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            p = Path(dirpath) / f
            rel = str(p.relative_to(root))
            out[rel] = "-> " + os.readlink(p) if p.is_symlink() else p.read_text()
    return dict(sorted(out.items()))


def test_bad_manifest_is_skipped_and_the_rest_generated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mdir = tmp_path / "providers"
    write(mdir, "aaa.toml", GOOD.format(port=9001))
    bad = write(
        mdir, "bbb.toml", '[listen]\naddress = "nowhere"\n[runtime]\ncommand = ["/x"]\nspeed = 1\n'
    )
    write(mdir, "ccc.toml", GOOD.format(port=9003))
    monkeypatch.setenv("PROVIDERD_MANIFEST_DIRS", str(mdir))
    log, buf = stderr_log()
    out = tmp_path / "normal"
    assert generator.main([str(out), str(tmp_path / "early"), str(tmp_path / "late")], log) == 0
    files = tree(out)
    assert "provider-worker@aaa.service.d/50-manifest.conf" in files
    assert "provider-worker@ccc.service.d/50-manifest.conf" in files
    assert not [f for f in files if "bbb" in f]
    pid = os.getpid()
    assert buf.getvalue().splitlines() == [
        f'providerd-generator[{pid}]: {bad}: listen.address: expected "host:port", "[v6]:port" or an absolute unix socket path, got "nowhere"',
        f"providerd-generator[{pid}]: {bad}: runtime.speed: unknown key",
        f'providerd-generator[{pid}]: Skipping provider "bbb": 2 problems; run "providerctl check {bad}" for details',
    ]
    assert not (tmp_path / "early").exists() and not (tmp_path / "late").exists()


def test_output_is_exactly_render_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mdir = tmp_path / "providers"
    write(mdir, "one.toml", GOOD.format(port=9001))
    write(mdir, "two/provider.toml", "enabled = false\n" + GOOD.format(port=9002))
    monkeypatch.setenv("PROVIDERD_MANIFEST_DIRS", str(mdir))
    out = tmp_path / "normal"
    log, buf = stderr_log()
    assert generator.main([str(out)], log) == 0
    assert buf.getvalue() == ""
    found = manifest.discover()
    expected = {
        k: ("-> " + v.target if isinstance(v, units.Link) else v)
        for k, v in units.render_all(list(found.providers.values())).items()
    }
    assert tree(out) == expected
    assert (out / "sockets.target.wants" / "provider@one.socket").is_symlink()
    assert not (out / "sockets.target.wants" / "provider@two.socket").exists()


def test_same_input_same_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mdir = tmp_path / "providers"
    for i in range(5):
        write(mdir, f"p{i}.toml", GOOD.format(port=9000 + i))
    monkeypatch.setenv("PROVIDERD_MANIFEST_DIRS", str(mdir))
    generator.main([str(tmp_path / "a")], stderr_log()[0])
    generator.main([str(tmp_path / "b")], stderr_log()[0])
    assert tree(tmp_path / "a") == tree(tmp_path / "b")


def test_no_output_directory_still_exits_0() -> None:
    log, buf = stderr_log()
    assert generator.main([], log) == 0
    assert "Failed to run: expected the output directory" in buf.getvalue()


def test_unwritable_output_is_logged_and_exits_0(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mdir = tmp_path / "providers"
    write(mdir, "one.toml", GOOD.format(port=9001))
    monkeypatch.setenv("PROVIDERD_MANIFEST_DIRS", str(mdir))
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    log, buf = stderr_log()
    assert generator.main([str(blocker)], log) == 0
    assert "Failed to write" in buf.getvalue()


def test_a_failed_write_leaves_the_old_file_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "x.d" / "50-manifest.conf"
    generator.write_atomic(target, "old\n")

    def broken_replace(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError):
        generator.write_atomic(target, "new\n")
    assert target.read_text() == "old\n"
    assert os.listdir(target.parent) == ["50-manifest.conf"]


def test_write_atomic_replaces_links_and_files(tmp_path: Path) -> None:
    link = tmp_path / "w" / "provider@a.socket"
    generator.write_atomic(link, units.Link("/lib/one"))
    generator.write_atomic(link, units.Link("/lib/two"))
    assert os.readlink(link) == "/lib/two"
    assert os.listdir(link.parent) == ["provider@a.socket"]


def test_kmsg_lines_carry_the_priority(tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("")
    log = generator.Log(kmsg=str(kmsg))
    log('Skipping provider "x"')
    log.close()
    assert kmsg.read_text() == f'<3>providerd-generator[{os.getpid()}]: Skipping provider "x"\n'


def test_a_broken_discovery_never_fails_the_boot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def explode(*args: object, **kwargs: object) -> None:
        raise RuntimeError("unexpected")

    monkeypatch.setattr(manifest, "discover", explode)
    log, buf = stderr_log()
    assert generator.main([str(tmp_path)], log) == 0
    assert "Failed to read manifests: unexpected" in buf.getvalue()
