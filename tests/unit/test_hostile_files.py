"""One file, whatever it holds or is, costs only itself: every reproduction of a file
that once broke discovery, the generator, `providerctl check` or providerd.toml."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from cases.harness import CASES, REPO, directives, write

from agent.spec import manifest, values
from agent.spec import settings as config
from agent.spec.provider import Provider
from agent.systemd import generator, manifests

GOOD = '[listen]\naddress = "127.0.0.1:18010"\n[runtime]\ncommand = ["/bin/true"]\n'
HOSTILE = sorted(p for p in (CASES / "invalid").glob("*.toml") if directives(p, "expect"))
CONFIG_CASES = sorted((CASES / "config").glob("*.toml"))


@pytest.fixture(autouse=True)
def trusted_self(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROVIDERD_TRUSTED_UID", str(os.getuid()))
    monkeypatch.delenv("PROVIDERD_MANIFEST", raising=False)


@pytest.fixture
def deadline() -> Iterator[None]:
    """Fail, rather than hang, when something blocks (a FIFO opened for reading)."""

    def expired(signum: int, frame: object) -> None:
        raise TimeoutError("blocked for 10 s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(10)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def hostile_directory(root: Path) -> tuple[Path, list[Path]]:
    """A manifest directory with one good manifest and every hostile kind of entry."""
    mdir = root / "providers"
    write(mdir, "good.toml", GOOD)
    bad = []
    for case in HOSTILE:
        bad.append(write(mdir, case.name, case.read_text(encoding="utf-8")))
    os.symlink("loop", mdir / "loop")  # a symlink loop without .toml: ELOOP from is_dir()
    os.symlink("selfloop.toml", mdir / "selfloop.toml")
    os.mkfifo(mdir / "fifo.toml")
    os.symlink("/dev/zero", mdir / "zero.toml")
    (mdir / "dir.toml").mkdir()
    name = os.path.join(os.fsencode(mdir), b"caf\xe9.toml")  # not UTF-8
    fd = os.open(name, os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(fd, GOOD.replace("18010", "18099").encode())
    os.close(fd)
    big = write(mdir, "big.toml", "#" * (manifest.MAX_MANIFEST_BYTES + 1))
    bad += [mdir / "selfloop.toml", mdir / "fifo.toml", mdir / "zero.toml", mdir / "dir.toml", big]
    bad.append(Path(os.fsdecode(name)))
    return mdir, bad


def test_every_hostile_entry_is_its_own_problem_and_the_good_one_stays(
    tmp_path: Path, deadline: None
) -> None:
    mdir, bad = hostile_directory(tmp_path)
    found = manifest.discover([mdir])
    assert list(found.providers) == ["good"]
    assert {p.file for p in found.problems} == {str(b) for b in bad}
    for p in found.problems:
        line = str(p)
        assert "\n" not in line and line.encode("utf-8")  # one printable line
        assert "Traceback" not in line


def test_check_prints_one_line_per_problem_and_never_a_traceback(
    tmp_path: Path, deadline: None
) -> None:
    mdir, bad = hostile_directory(tmp_path)
    r = subprocess.run(
        [sys.executable, "-m", "agent", "check", str(mdir)],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO), LANG="C.UTF-8"),
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 1, r.stderr
    assert b"Traceback" not in r.stdout + r.stderr
    out = r.stdout.decode("utf-8")  # valid UTF-8, whatever the names are
    assert f"{mdir}/caf\\xe9.toml: " in out
    lines = out.splitlines()
    assert {line.split(": ", 1)[0] for line in lines} == {
        str(b).replace("\udce9", "\\xe9") for b in bad
    }


def test_the_generator_writes_the_good_provider_and_logs_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, deadline: None
) -> None:
    mdir, bad = hostile_directory(tmp_path)
    monkeypatch.setenv("PROVIDERD_MANIFEST_DIRS", str(mdir))
    monkeypatch.setenv("PROVIDERD_CONFIG", str(tmp_path / "absent.toml"))
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("")
    out = tmp_path / "normal"
    assert generator.main([str(out)], generator.Log(kmsg=str(kmsg))) == 0
    made = sorted(str(p.relative_to(out)) for p in out.rglob("*") if not p.is_dir())
    assert made == [
        "provider-worker@good.service.d/50-manifest.conf",
        "provider@good.service.d/50-manifest.conf",
        "provider@good.socket.d/50-manifest.conf",
        "providerd.json",
        "sockets.target.wants/provider@good.socket",
    ]
    logged = kmsg.read_bytes().decode("utf-8")
    assert f'{mdir}/caf\\xe9.toml: "caf\\xe9" is not a valid provider name' in logged
    assert "Failed to read manifests" not in logged
    assert all(line.startswith("<3>providerd-generator[") for line in logged.splitlines())
    for b in bad:
        assert f'Skipping provider "{manifest.slug_of(b)}"'.replace("\udce9", "\\xe9") in logged


def test_a_directory_that_cannot_be_listed_is_a_problem(tmp_path: Path) -> None:
    not_a_dir = write(tmp_path, "file", "")
    found = manifest.discover([not_a_dir, tmp_path / "absent"])
    assert found.problems == [] and found.providers == {}
    unlistable = tmp_path / ("x" * 300)  # ENAMETOOLONG: it is not simply absent
    found = manifest.discover([unlistable])
    assert [p.message for p in found.problems] == ["Failed to list manifests: File name too long"]


def test_anything_unexpected_is_a_problem_of_that_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The boundary, not a case: a check that raises becomes one line of that file."""
    write(tmp_path, "good.toml", GOOD)
    bad = write(tmp_path, "bad.toml", GOOD.replace("18010", "18011"))
    real = manifest.validate

    def validate(data: dict[str, object], slug: str, source: Path, host: object) -> object:
        if slug == "bad":
            raise OverflowError("cannot convert float infinity to integer")
        return real(data, slug, source, host)  # type: ignore[arg-type]

    monkeypatch.setattr(manifest, "validate", validate)
    found = manifest.discover([tmp_path])
    assert list(found.providers) == ["good"]
    assert [str(p) for p in found.problems] == [
        f"{bad}: Failed to read manifest: OverflowError: cannot convert float infinity to integer"
    ]


# -- providerd.toml ------------------------------------------------------------------------


@pytest.mark.parametrize("case", CONFIG_CASES, ids=[c.stem for c in CONFIG_CASES])
def test_config_case_yields_exactly_its_expected_lines(case: Path, tmp_path: Path) -> None:
    expected = directives(case, "expect")
    assert expected, f"{case.name} states no expectation"
    path = write(tmp_path, "providerd.toml", case.read_text(encoding="utf-8"))
    with pytest.raises(config.ConfigError) as e:
        config.load(path)
    assert [str(p) for p in e.value.problems] == [f"{path}: {x}" for x in expected]


def test_a_fifo_as_providerd_toml_is_refused_at_once(tmp_path: Path, deadline: None) -> None:
    fifo = tmp_path / "providerd.toml"
    os.mkfifo(fifo)
    with pytest.raises(config.ConfigError) as e:
        config.load(fifo)
    assert [str(p) for p in e.value.problems] == [f"{fifo}: is not a regular file"]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p.mkdir(), "is a directory, expected a providerd.toml file"),
        (lambda p: p.symlink_to("/dev/zero"), "is not a regular file"),
        (
            lambda p: p.symlink_to(p),
            "Failed to read providerd.toml: Too many levels of symbolic links",
        ),
        (
            lambda p: p.write_text("#" * (config.MAX_CONFIG_BYTES + 1)),
            f"is {config.MAX_CONFIG_BYTES + 1} bytes; a providerd.toml may be at most 65536 bytes",
        ),
    ],
)
def test_providerd_toml_must_be_a_small_regular_file(
    tmp_path: Path, make: object, message: str
) -> None:
    path = tmp_path / "providerd.toml"
    make(path)  # type: ignore[operator]
    with pytest.raises(config.ConfigError) as e:
        config.load(path)
    assert [p.message for p in e.value.problems] == [message]


def test_providerd_toml_must_be_owned_by_root_and_not_writable_by_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path, "providerd.toml", "[router]\nenabled = true\n")
    assert config.load(path).router.enabled
    path.chmod(0o666)
    with pytest.raises(config.ConfigError) as e:
        config.load(path)
    assert [p.message for p in e.value.problems] == [
        f"{path} is writable by group or others (mode 0666); providerd.toml decides where "
        f"providerd listens: chmod go-w {path}"
    ]
    path.chmod(0o644)
    tmp_path.chmod(0o777)
    with pytest.raises(config.ConfigError) as e:
        config.load(path)
    assert "writable by group or others (mode 0777)" in e.value.problems[0].message
    tmp_path.chmod(0o755)
    if os.getuid() == 0:
        os.chown(path, 4242, -1)
    else:
        monkeypatch.delenv("PROVIDERD_TRUSTED_UID")
    with pytest.raises(config.ConfigError) as e:
        config.load(path)
    assert "not by root" in e.value.problems[0].message


def test_a_bad_providerd_toml_leaves_the_providers_generated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, deadline: None
) -> None:
    mdir = tmp_path / "providers"
    write(mdir, "good.toml", GOOD)
    fifo = tmp_path / "providerd.toml"
    os.mkfifo(fifo)
    monkeypatch.setenv("PROVIDERD_MANIFEST_DIRS", str(mdir))
    monkeypatch.setenv("PROVIDERD_CONFIG", str(fifo))
    buf = io.StringIO()
    out = tmp_path / "normal"
    assert generator.main([str(out)], generator.Log(kmsg="/nonexistent", fallback=buf)) == 0
    assert (out / "provider@good.socket.d" / "50-manifest.conf").exists()
    assert not (out / "providerd-router.socket.d").exists()
    assert f"{fifo}: is not a regular file" in buf.getvalue()
    assert "Skipping the router's settings" in buf.getvalue()


def test_a_valid_manifest_is_still_a_provider(tmp_path: Path) -> None:
    assert isinstance(manifest.parse_file(write(tmp_path, "ok.toml", GOOD)), Provider)


def test_the_renderer_refuses_what_a_check_let_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Should a check ever miss a line break (as the scope check once did), the renderer's
    own guard makes it a problem of that manifest: nothing reaches a unit."""
    monkeypatch.setattr(values, "_scope_problem", lambda host: None)
    write(tmp_path, "good.toml", GOOD)
    bad = write(
        tmp_path,
        "bad.toml",
        '[listen]\naddress = ["[::1%lo\\nExecStartPre=pwned\\n#]:18012"]\n'
        '[runtime]\ncommand = ["/bin/true"]\n',
    )
    found = manifests.discover([tmp_path])
    assert list(found.providers) == ["good"]
    assert [str(p) for p in found.problems] == [
        f"{bad}: cannot be written safely as ListenStream=: the value holds the control "
        "character U+000A"
    ]
