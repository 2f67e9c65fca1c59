"""Manifest parsing and validation: the case files, the examples, hostile input."""

from __future__ import annotations

import dataclasses
import io
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from cases.harness import ANY_PATHS_HOST, CASE_HOST, CASES, EXAMPLES, directives, install, write

from agent.cli import check
from agent.spec import keys, manifest, values
from agent.spec.provider import Address, Provider, Ready
from agent.systemd import units

INVALID = sorted((CASES / "invalid").glob("*.toml"))
MINIMAL = '[listen]\naddress = "127.0.0.1:8008"\n[runtime]\ncommand = ["/bin/true"]\n'


@pytest.fixture(autouse=True)
def trusted_self(monkeypatch: pytest.MonkeyPatch) -> None:
    """Accept the test's own user as manifest owner (the documented way; the check stays on)."""
    monkeypatch.setenv("PROVIDERD_TRUSTED_UID", str(os.getuid()))
    monkeypatch.delenv("PROVIDERD_MANIFEST", raising=False)


def problem_lines(result: Provider | list[manifest.Problem], path: Path) -> list[str]:
    assert isinstance(result, list), f"expected problems, got {result}"
    prefix = f"{path}: "
    assert all(str(p).startswith(prefix) for p in result)
    return [str(p)[len(prefix) :] for p in result]


@pytest.mark.parametrize("case", INVALID, ids=[c.stem for c in INVALID])
def test_invalid_case_yields_exactly_its_expected_lines(case: Path, tmp_path: Path) -> None:
    path = install(case, tmp_path / "providers")
    expected = directives(case, "expect")
    assert expected, f"{case.name} states no expectation"
    assert problem_lines(manifest.parse_file(path, host=CASE_HOST), path) == expected


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.toml")))
def test_example_is_valid(name: str, tmp_path: Path) -> None:
    path = install(EXAMPLES / name, tmp_path / "providers")
    result = manifest.parse_file(path, host=ANY_PATHS_HOST)
    assert isinstance(result, Provider), result
    # On this machine only the documented weight paths may be missing.
    real = manifest.parse_file(path)
    if isinstance(real, list):
        assert all(p.key == "weights.paths" and "does not exist" in p.message for p in real), real


def test_examples_do_not_collide(tmp_path: Path) -> None:
    for p in EXAMPLES.glob("*.toml"):
        install(p, tmp_path / "providers")
    found = manifest.discover([tmp_path / "providers"], host=ANY_PATHS_HOST)
    assert found.problems == []
    assert list(found.providers) == sorted(p.stem for p in EXAMPLES.glob("*.toml"))


def test_demo_example_is_what_the_demo_needs(tmp_path: Path) -> None:
    p = manifest.parse_file(install(EXAMPLES / "demo.toml", tmp_path / "p"))
    assert isinstance(p, Provider)
    assert p.command == ("{python}", "-m", "agent.demo", "--port", "{port}", "--load-delay", "2")
    assert p.ready == Ready("http", "/health")
    assert p.addresses == (Address("127.0.0.1", 8008),)
    assert p.idle_ignore_paths == ("/health",)
    assert p.idle_timeout_s <= 30
    assert not p.uses_gpu


def test_defaults_match_the_key_table(tmp_path: Path) -> None:
    p = manifest.parse_file(write(tmp_path, "m.toml", MINIMAL))
    assert isinstance(p, Provider)
    assert p.enabled is True and p.protocol == "http" and p.mode == "resident"
    assert p.ready == Ready("tcp") and p.worker_port == 0 and p.max_held == 1024
    assert (p.start_timeout_s, p.request_timeout_s, p.idle_timeout_s, p.stop_timeout_s) == (
        900,
        300,
        600,
        30,
    )
    assert p.gpu_devices == "none" and p.network == "private" and p.working_directory is None
    for key in keys.KEYS:
        if key.default in ("true", "false"):
            assert str(getattr(p, key.name)).lower() == key.default
        elif key.kind in ("int", "seconds") and key.default.replace(".", "").isdigit():
            field = manifest._field(key)
            assert getattr(p, field) == float(key.default), key.dotted


def test_every_key_fills_a_provider_field() -> None:
    fields = {f.name for f in dataclasses.fields(Provider)}
    for key in keys.KEYS:
        assert manifest._field(key) in fields, key.dotted
        assert key.kind in keys.KINDS and key.kind in values.CONVERTERS


def test_gpu_table_defaults_to_auto(tmp_path: Path) -> None:
    p = manifest.parse_file(write(tmp_path, "g.toml", MINIMAL + "[gpu]\nvram_budget_gb = 8\n"))
    assert isinstance(p, Provider)
    assert p.gpu_devices == "auto" and p.uses_gpu and p.vram_budget_gb == 8.0


def test_forms_are_normalised(tmp_path: Path) -> None:
    text = (
        '[listen]\naddress = ["[::1]:80", "/run/x/../y.sock", "0.0.0.0:81"]\nallow = ["10.1.2.3/8"]\n'
        '[runtime]\nlaunch = "pkg.mod:fn"\nready = "http:/h"\n'
        '[limits]\nmemory_max = "1.5G"\ncpu_quota = "100%"\n'
    )
    p = manifest.parse_file(write(tmp_path, "n.toml", text))
    assert isinstance(p, Provider)
    assert [str(a) for a in p.addresses] == ["[::1]:80", "/run/y.sock", "0.0.0.0:81"]
    assert p.allow == ("10.0.0.0/8",)
    assert p.memory_max == 1536 << 20 and p.cpu_quota == 100 and p.launch == "pkg.mod:fn"


def test_cpu_quota_is_bounded_by_this_hosts_cpus(tmp_path: Path) -> None:
    top = (os.cpu_count() or 1) * 100
    ok = manifest.parse_file(
        write(tmp_path, "a.toml", MINIMAL + f'[limits]\ncpu_quota = "{top}%"\n')
    )
    assert isinstance(ok, Provider)
    bad = manifest.parse_file(
        write(tmp_path, "b.toml", MINIMAL + f'[limits]\ncpu_quota = "{top + 1}%"\n')
    )
    assert isinstance(bad, list) and f"from 1% to {top}%" in bad[0].message


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("UPPER.toml", '"UPPER" is not a valid provider name'),
        ("a" * 49 + ".toml", "at most 48 characters"),
        ("with.dot.toml", '"with.dot" is not a valid provider name'),
    ],
)
def test_slug_rules(tmp_path: Path, name: str, message: str) -> None:
    r = manifest.parse_file(write(tmp_path, name, MINIMAL))
    assert isinstance(r, list) and message in r[0].message and r[0].key == ""


def test_slug_of_a_directory_manifest_and_its_working_directory(tmp_path: Path) -> None:
    path = write(tmp_path, "esm/provider.toml", MINIMAL)
    p = manifest.parse_file(path)
    assert isinstance(p, Provider)
    assert p.slug == "esm" and p.working_directory == str(tmp_path / "esm")


# -- hostile input: a problem line, never a traceback ------------------------------------------


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\x00\xff\xfe garbage \x80", "is not UTF-8 text"),
        (b"", "required key is missing"),
        (b"= = =", "is not valid TOML"),
        (b'[listen]\naddress = "127.0.0.1:1"\n[runtime]\ncommand = ["a\\u0000b"]\n', "NUL"),
        (b"x" * (manifest.MAX_MANIFEST_BYTES + 1), "at most 1 MiB"),
    ],
)
def test_garbage_is_a_problem_not_a_traceback(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "g.toml"
    path.write_bytes(content)
    path.chmod(0o644)
    r = manifest.parse_file(path)
    assert isinstance(r, list) and any(message in p.message for p in r), r


def test_directory_named_like_a_manifest(tmp_path: Path) -> None:
    d = tmp_path / "esm.toml"
    d.mkdir()
    r = manifest.parse_file(d)
    assert isinstance(r, list) and r[0].message == "is a directory, expected a manifest file"
    out = io.StringIO()
    assert check.main_check([str(tmp_path)], out, io.StringIO()) == 1
    assert out.getvalue() == f"{d}: is a directory, expected a manifest file\n"


def test_unreadable_and_missing_files(tmp_path: Path) -> None:
    link = tmp_path / "dangling.toml"
    link.symlink_to(tmp_path / "nowhere")
    r = manifest.parse_file(link)
    assert isinstance(r, list) and r[0].message.startswith("Failed to read manifest: No such file")
    if os.getuid() != 0:  # root reads anything
        f = write(tmp_path, "secret.toml", MINIMAL)
        f.chmod(0)
        r = manifest.parse_file(f)
        assert isinstance(r, list) and "Permission denied" in r[0].message
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    r = manifest.parse_file(fifo)
    assert isinstance(r, list) and r[0].message == "is not a regular file"


# -- ownership and modes -------------------------------------------------------------------------


def test_group_writable_file_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "w.toml", MINIMAL)
    path.chmod(0o664)
    r = manifest.parse_file(path)
    assert isinstance(r, list)
    assert [p.message for p in r] == [
        f"{path} is writable by group or others (mode 0664); manifests run commands on the host: chmod go-w {path}"
    ]


def test_writable_directory_on_the_path_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path / "providers", "esm/provider.toml", MINIMAL)
    (tmp_path / "providers" / "esm").chmod(0o777)
    r = manifest.parse_file(path)
    assert (
        isinstance(r, list)
        and "providers/esm is writable by group or others (mode 0777)" in r[0].message
    )
    (tmp_path / "providers" / "esm").chmod(0o755)
    (tmp_path / "providers").chmod(0o775)
    r = manifest.parse_file(path)
    assert (
        isinstance(r, list)
        and "providers is writable by group or others (mode 0775)" in r[0].message
    )
    (tmp_path / "providers").chmod(0o1777)  # sticky, as /tmp: others cannot replace the file
    assert isinstance(manifest.parse_file(path), Provider)


def test_owner_must_be_trusted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, "o.toml", MINIMAL)
    if os.getuid() == 0:
        os.chown(path, 4242, -1)
    else:
        monkeypatch.delenv("PROVIDERD_TRUSTED_UID")
    r = manifest.parse_file(path)
    assert isinstance(r, list)
    assert "not by root" in r[0].message and "only root may own them" in r[0].message


# -- discovery and the checks across manifests ----------------------------------------------


def test_etc_beats_usr_lib_for_one_slug(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    etc, lib = tmp_path / "etc", tmp_path / "lib"
    write(etc, "esm.toml", MINIMAL)
    write(lib, "esm.toml", MINIMAL.replace("8008", "8009"))
    write(lib, "other.toml", MINIMAL.replace("8008", "8010"))
    monkeypatch.setenv("PROVIDERD_MANIFEST_DIRS", f"{etc}:{lib}")
    found = manifest.discover()
    assert found.problems == []
    assert list(found.providers) == ["esm", "other"]
    assert found.providers["esm"].source == etc / "esm.toml"


def test_one_slug_twice_in_one_directory_refuses_both(tmp_path: Path) -> None:
    a = write(tmp_path, "esm.toml", MINIMAL)
    b = write(tmp_path, "esm/provider.toml", MINIMAL.replace("8008", "8009"))
    found = manifest.discover([tmp_path])
    assert found.providers == {}
    assert [str(p) for p in found.problems] == [
        f'{a}: provider "esm" is also declared by {b}; keep one',
        f'{b}: provider "esm" is also declared by {a}; keep one',
    ]


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("127.0.0.1:8008", "127.0.0.1:8008"),
        ("0.0.0.0:8008", "127.0.0.1:8008"),
        ("[::]:8008", "127.0.0.1:8008"),
        ("/run/p.sock", "/run/p.sock"),
    ],
)
def test_shared_address_refuses_both(tmp_path: Path, first: str, second: str) -> None:
    a = write(tmp_path, "a.toml", MINIMAL.replace("127.0.0.1:8008", first))
    b = write(tmp_path, "b.toml", MINIMAL.replace("127.0.0.1:8008", second))
    write(tmp_path, "c.toml", MINIMAL.replace("8008", "9999"))
    found = manifest.discover([tmp_path])
    assert list(found.providers) == ["c"]
    assert [(p.file, p.key) for p in found.problems] == [
        (str(a), "listen.address"),
        (str(b), "listen.address"),
    ]
    assert f'used by provider "b" ({b})' in found.problems[0].message
    assert f'used by provider "a" ({a})' in found.problems[1].message


def test_distinct_addresses_on_one_port_are_fine(tmp_path: Path) -> None:
    write(tmp_path, "a.toml", MINIMAL.replace("127.0.0.1:8008", "127.0.0.1:8008"))
    write(tmp_path, "b.toml", MINIMAL.replace("127.0.0.1:8008", "127.0.0.2:8008"))
    write(tmp_path, "c.toml", MINIMAL.replace("127.0.0.1:8008", "[::1]:8008"))
    assert manifest.discover([tmp_path]).problems == []


def test_model_name_collisions_refuse_both(tmp_path: Path) -> None:
    a = write(tmp_path, "a.toml", MINIMAL + '[models]\nnames = ["m1", "shared"]\n')
    b = write(
        tmp_path, "b.toml", MINIMAL.replace("8008", "8009") + '[models]\nnames = ["shared"]\n'
    )
    c = write(
        tmp_path, "c.toml", MINIMAL.replace("8008", "8010") + '[models]\npatterns = ["m[0-9]"]\n'
    )
    write(tmp_path, "d.toml", MINIMAL.replace("8008", "8011") + '[models]\npatterns = ["x.*"]\n')
    found = manifest.discover([tmp_path])
    assert list(found.providers) == ["d"]
    lines = [str(p) for p in found.problems]
    assert (
        f'{a}: models.names: "shared" is also claimed by provider "b" ({b}); a model name belongs to one provider'
        in lines
    )
    assert (
        f'{b}: models.names: "shared" is also claimed by provider "a" ({a}); a model name belongs to one provider'
        in lines
    )
    assert (
        f'{c}: models.patterns: "m[0-9]" matches "m1", a name of provider "a" ({a}); narrow the pattern'
        in lines
    )
    assert (
        f'{a}: models.names: "m1" is also matched by pattern "m[0-9]" of provider "c" ({c})'
        in lines
    )


def test_check_paths_takes_files_slug_directories_and_manifest_directories(tmp_path: Path) -> None:
    f = write(tmp_path / "x", "one.toml", MINIMAL)
    d = write(tmp_path / "y", "two/provider.toml", MINIMAL.replace("8008", "8009"))
    write(tmp_path / "z", "three.toml", MINIMAL.replace("8008", "8010"))
    found = manifest.check_paths([f, d.parent, tmp_path / "z", tmp_path / "missing.toml"])
    assert list(found.providers) == ["one", "three", "two"]
    assert [str(p) for p in found.problems] == [
        f"{tmp_path / 'missing.toml'}: No such file or directory"
    ]


def test_load_prefers_providerd_manifest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path / "elsewhere", "demo.toml", MINIMAL)
    monkeypatch.setenv("PROVIDERD_MANIFEST_DIRS", str(tmp_path / "empty"))
    monkeypatch.setenv("PROVIDERD_MANIFEST", str(path))
    assert manifest.load("demo").source == path
    path.chmod(0o666)
    with pytest.raises(manifest.ManifestError) as e:
        manifest.load("demo")
    assert "writable by group or others" in str(e.value)


def test_load_by_slug(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path, "good.toml", MINIMAL)
    write(tmp_path, "bad.toml", "[listen]\n")
    monkeypatch.setenv("PROVIDERD_MANIFEST_DIRS", str(tmp_path))
    assert manifest.load("good").slug == "good"
    with pytest.raises(manifest.ManifestError) as e:
        manifest.load("bad")
    assert all(p.file == str(tmp_path / "bad.toml") for p in e.value.problems)
    with pytest.raises(manifest.ManifestError) as e:
        manifest.load("nope")
    assert 'no manifest for provider "nope"' in str(e.value)


# -- providerctl check -------------------------------------------------------------------------


def test_check_prints_every_problem_one_line_and_exits_1(tmp_path: Path) -> None:
    bad = write(tmp_path, "bad.toml", '[listen]\naddress = "127.0.0.1:0"\n[runtime]\ncomand = []\n')
    write(tmp_path, "good.toml", MINIMAL)
    out, err = io.StringIO(), io.StringIO()
    assert check.main_check([str(tmp_path)], out, err) == 1
    assert out.getvalue().splitlines() == [
        f'{bad}: listen.address: port must be from 1 to 65535, got "0" in "127.0.0.1:0"',
        f'{bad}: runtime.comand: unknown key (did you mean "command"?)',
        f'{bad}: runtime: one of "command" (argv) or "launch" ("package.module:function") is required',
    ]
    assert err.getvalue() == ""


def test_check_summarises_valid_providers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(
        tmp_path,
        "one.toml",
        MINIMAL.replace('["/bin/true"]', '["/opt/s", "--port", "{port}", "a b"]'),
    )
    write(
        tmp_path,
        "two.toml",
        'enabled = false\n[listen]\naddress = ["[::1]:1", "/run/t.sock"]\n'
        'protocol = "tcp"\n[runtime]\nlaunch = "p.m:f"\n',
    )
    monkeypatch.setenv("PROVIDERD_MANIFEST_DIRS", str(tmp_path))
    out = io.StringIO()
    assert check.main_check([], out, io.StringIO()) == 0
    assert out.getvalue() == (
        "one: 127.0.0.1:8008 (http) -> /opt/s --port {port} 'a b'\n"
        "two: [::1]:1, /run/t.sock (tcp) (disabled) -> launch p.m:f\n"
    )


def test_check_with_nothing_to_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROVIDERD_MANIFEST_DIRS", str(tmp_path / "none"))
    out, err = io.StringIO(), io.StringIO()
    assert check.main_check([], out, err) == 0
    assert out.getvalue() == "" and "no manifests found" in err.getvalue()


# -- the reference stays generated from the table ----------------------------------------------


def test_docs_match_the_key_table() -> None:
    repo = CASES.parent.parent
    hint = "regenerate with: python3 -m agent.spec.keys --markdown > docs/manifest.md"
    assert (repo / "docs" / "manifest.md").read_text(encoding="utf-8") == keys.markdown(), hint
    hint = "regenerate with: python3 -m agent.spec.keys --man > docs/man/provider.toml.5"
    assert (repo / "docs" / "man" / "provider.toml.5").read_text(encoding="utf-8") == keys.man(), (
        hint
    )


def test_every_key_is_in_both_references() -> None:
    md, man = keys.markdown(), keys.man()
    for key in keys.KEYS:
        assert f"| `{key.name}` |" in md, key.dotted
        assert f"\\fB{key.name}\\fR" in man, key.dotted
        assert key.meaning and key.type


def test_keys_module_prints_the_references(capsys: pytest.CaptureFixture[str]) -> None:
    assert keys.main(["--markdown"]) == 0
    assert capsys.readouterr().out == keys.markdown()
    assert keys.main(["--man"]) == 0
    assert capsys.readouterr().out == keys.man()
    assert keys.main([]) == 2


def test_check_reads_each_file_once(tmp_path: Path) -> None:
    f = write(tmp_path, "one.toml", MINIMAL)
    found = manifest.check_paths([f, tmp_path, f])
    assert found.problems == [] and list(found.providers) == ["one"]
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"\xff")
    bad.chmod(0o644)
    out = io.StringIO()
    assert check.main_check([str(bad), str(tmp_path)], out, io.StringIO()) == 1
    assert out.getvalue() == f"{bad}: is not UTF-8 text (byte 0); a manifest is a TOML file\n"


def test_not_a_number_is_refused(tmp_path: Path) -> None:
    r = manifest.parse_file(write(tmp_path, "n.toml", MINIMAL + "idle_timeout_s = nan\n"))
    assert (
        isinstance(r, list) and r[0].key == "runtime.idle_timeout_s" and "got nan" in r[0].message
    )


def test_mutated_manifests_never_raise() -> None:
    """Deterministic fuzzing: every example with bytes dropped, repeated or replaced."""
    import random

    rng = random.Random(2)
    sources = [p.read_bytes() for p in sorted(EXAMPLES.glob("*.toml"))]
    alphabet = b'[]{}=",.:/\\%$#\n 0123456789azAZ-_\x00\xff'
    for _ in range(1500):
        data = bytearray(rng.choice(sources))
        for _ in range(rng.randint(1, 6)):
            i = rng.randrange(len(data))
            op = rng.randrange(3)
            if op == 0:
                del data[i]
            elif op == 1:
                data[i:i] = data[i : i + rng.randint(1, 20)]
            else:
                data[i] = rng.choice(alphabet)
        result = manifest.parse_bytes(bytes(data), Path("/m/fuzz.toml"), "fuzz", ANY_PATHS_HOST)
        assert isinstance(result, Provider | list)
        if isinstance(result, Provider):
            assert units.render(result)


# -- secrets: credentials, and environment names that look like one ---------------------------


def test_credentials_are_a_table_of_existing_absolute_paths(tmp_path: Path) -> None:
    secret = tmp_path / "hf"
    secret.write_text("hf_abc\n")
    path = write(
        tmp_path / "providers",
        "c.toml",
        MINIMAL + f'credentials = {{ HF_TOKEN = "{secret}" }}\n',
    )
    p = manifest.parse_file(path)
    assert isinstance(p, Provider), p
    assert p.credentials == (("HF_TOKEN", str(secret)),)
    assert p.environment == ()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('"x"', "expected a table of absolute paths"),
        ('{ "1X" = "/srv/present/a" }', "is not a credential name"),
        ('{ PROVIDERD_X = "/srv/present/a" }', "set by providerd or systemd"),
        ('{ X = "relative" }', "expected an absolute path"),
        ("{ X = 3 }", "expected the absolute path of a file"),
    ],
)
def test_credential_problems(tmp_path: Path, value: str, message: str) -> None:
    path = write(tmp_path / "providers", "c.toml", MINIMAL + f"credentials = {value}\n")
    lines = problem_lines(manifest.parse_file(path, host=CASE_HOST), path)
    assert len(lines) == 1 and lines[0].startswith("runtime.credentials: "), lines
    assert message in lines[0], lines


def test_a_name_in_both_environment_and_credentials_is_refused(tmp_path: Path) -> None:
    text = (
        MINIMAL
        + 'environment = { HF_TOKEN = "x" }\ncredentials = { HF_TOKEN = "/srv/present/a" }\n'
    )
    path = write(tmp_path / "providers", "c.toml", text)
    assert problem_lines(manifest.parse_file(path, host=CASE_HOST), path) == [
        "runtime.credentials: HF_TOKEN is also in runtime.environment; a secret belongs in "
        "credentials only"
    ]


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("socket_mode", '"0666x"', 'expected an octal mode such as "0660"'),
        ("socket_mode", '"1777"', 'expected an octal mode such as "0660"'),
        ("socket_mode", "660", "expected an octal mode as a string"),
        ("socket_group", '"bad group"', "is not a group name"),
        ("socket_group", '"x\\nExecStartPre=/bin/sh"', "is not a group name"),
    ],
)
def test_socket_mode_and_group_problems(tmp_path: Path, key: str, value: str, message: str) -> None:
    text = (
        f'[listen]\naddress = "/run/x.sock"\n{key} = {value}\n[runtime]\ncommand = ["/bin/true"]\n'
    )
    path = write(tmp_path / "providers", "s.toml", text)
    lines = problem_lines(manifest.parse_file(path), path)
    assert len(lines) == 1 and lines[0].startswith(f"listen.{key}: ") and message in lines[0]


def test_socket_mode_and_group(tmp_path: Path) -> None:
    text = '[listen]\naddress = "/run/x.sock"\nsocket_mode = "600"\nsocket_group = "ml-users"\n'
    path = write(tmp_path / "providers", "s.toml", text + '[runtime]\ncommand = ["/bin/true"]\n')
    p = manifest.parse_file(path)
    assert isinstance(p, Provider), p
    assert (p.socket_mode, p.socket_group) == (0o600, "ml-users")


def test_check_warns_of_secret_looking_environment(tmp_path: Path) -> None:
    env = 'environment = { HF_TOKEN = "hf_x", OPENAI_API_KEY = "k", DB_PASSWORD = "p", HF_HOME = "/h" }\n'
    path = write(tmp_path / "providers", "w.toml", MINIMAL + env)
    out, err = io.StringIO(), io.StringIO()
    assert check.main_check([str(path)], out, err) == 0  # a warning, not a problem
    warnings = err.getvalue().splitlines()
    assert [w.split(": ")[1] for w in warnings] == [
        "runtime.environment.HF_TOKEN",
        "runtime.environment.OPENAI_API_KEY",
        "runtime.environment.DB_PASSWORD",
    ]
    assert all(w.startswith(f"{path}: ") and "[runtime] credentials = {" in w for w in warnings)
    assert "systemctl show" in warnings[0]
    assert out.getvalue().startswith("w: ")


def test_check_warns_of_missing_or_readable_credentials(tmp_path: Path) -> None:
    readable = tmp_path / "readable"
    readable.write_text("x")
    readable.chmod(0o644)
    creds = f'credentials = {{ GONE = "{tmp_path}/gone", OPEN = "{readable}" }}\n'
    path = write(tmp_path / "providers", "c.toml", MINIMAL + creds)
    out, err = io.StringIO(), io.StringIO()
    assert check.main_check([str(path)], out, err) == 0
    gone, loose = err.getvalue().splitlines()
    assert gone.startswith(f"{path}: runtime.credentials.GONE: warning: {tmp_path}/gone: No such")
    assert "the worker will not start without it" in gone
    assert loose.startswith(f"{path}: runtime.credentials.OPEN: warning: {readable} is mode 0644")
    assert "make it root's, mode 0600" in loose


def test_check_warns_when_the_front_user_cannot_read_a_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pwd

    other = pwd.struct_passwd(("providerd", "x", 54321, 54321, "", "/nonexistent", "/bin/false"))
    monkeypatch.setattr(pwd, "getpwnam", lambda name: other)
    # pytest's tmp_path sits below 0700 directories: use one others may search.
    base = Path(tempfile.mkdtemp(dir="/var/tmp"))
    try:
        base.chmod(0o755)
        path = write(base / "providers", "r.toml", MINIMAL)
        out, err = io.StringIO(), io.StringIO()
        assert check.main_check([str(path)], out, err) == 0
        assert err.getvalue() == ""
        path.chmod(0o600)
        assert check.main_check([str(path)], out, err) == 0
        assert err.getvalue() == (
            f"{path}: warning: the user providerd cannot read this manifest, so the provider's "
            "front cannot start; make it 0644, or 0640 with group providerd\n"
        )
    finally:
        shutil.rmtree(base)
