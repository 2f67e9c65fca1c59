"""providerd.toml: defaults, strict parsing, and what the generator writes for the router."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from agent.spec import settings as config
from agent.spec.provider import Address
from agent.spec.settings import Config, GpuConfig, RouterConfig
from agent.systemd import generator, router_units


def problems(text: str) -> list[str]:
    result = config.parse(text.encode(), Path("/etc/providerd/providerd.toml"))
    assert isinstance(result, list), result
    return [str(p) for p in result]


def test_a_missing_file_means_the_defaults(tmp_path: Path) -> None:
    loaded = config.load(tmp_path / "absent.toml")
    assert loaded == Config()
    assert loaded.router == RouterConfig(
        enabled=False,
        addresses=(Address("127.0.0.1", 8100),),
        max_body=16 << 20,
        idle_timeout_s=600.0,
        log_requests=False,
    )
    assert loaded.gpu.headroom_bytes == 1 << 30
    assert loaded.source is None


def test_the_environment_moves_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "p.toml"
    path.write_text("[router]\nenabled = true\n")
    monkeypatch.setenv("PROVIDERD_CONFIG", str(path))
    loaded = config.load()
    assert loaded.router.enabled and loaded.source == path


def test_every_key() -> None:
    text = """
[router]
enabled = true
address = ["127.0.0.1:9100", "[::1]:9100", "/run/providerd-router.sock"]
max_body = "1.5M"
idle_timeout_s = 30
log_requests = true

[gpu]
headroom_gb = 0.5
"""
    result = config.parse(text.encode(), Path("/x.toml"))
    assert result == Config(
        router=RouterConfig(
            enabled=True,
            addresses=(
                Address("127.0.0.1", 9100),
                Address("::1", 9100),
                Address(None, None, "/run/providerd-router.sock"),
            ),
            max_body=int(1.5 * (1 << 20)),
            idle_timeout_s=30.0,
            log_requests=True,
        ),
        gpu=GpuConfig(headroom_gb=0.5),
        source=Path("/x.toml"),
    )
    assert config.parse(b'[router]\naddress = "127.0.0.1:1"\nmax_body = 4096\n', Path("/x")) == (
        Config(
            router=RouterConfig(addresses=(Address("127.0.0.1", 1),), max_body=4096),
            source=Path("/x"),
        )
    )


def test_unknown_tables_and_keys_are_errors_with_a_hint() -> None:
    assert problems("[routr]\nenabled = true\n[gpu]\nheadroom = 1\n[router]\nmax_bdy = 1\n") == [
        '/etc/providerd/providerd.toml: routr: unknown table (did you mean "[router]"?); '
        "known tables: [router], [gpu]",
        '/etc/providerd/providerd.toml: gpu.headroom: unknown key (did you mean "headroom_gb"?); '
        "known keys: headroom_gb",
        '/etc/providerd/providerd.toml: router.max_bdy: unknown key (did you mean "max_body"?); '
        "known keys: enabled, address, max_body, idle_timeout_s, log_requests",
    ]
    assert problems("enabled = true\n") == [
        "/etc/providerd/providerd.toml: enabled: unknown table; known tables: [router], [gpu]"
    ]


@pytest.mark.parametrize(
    ("text", "line"),
    [
        (
            '[router]\nenabled = "yes"\n',
            'router.enabled: expected true or false, got "yes"',
        ),
        (
            '[router]\naddress = "localhost:8100"\n',
            'router.address: "localhost" is not an IPv4 address; expected "host:port", '
            '"[v6]:port" or an absolute unix socket path',
        ),
        (
            "[router]\naddress = []\n",
            'router.address: expected at least one address such as "127.0.0.1:8008"',
        ),
        (
            '[router]\naddress = ["127.0.0.1:1", "127.0.0.1:1"]\n',
            'router.address: "127.0.0.1:1" is listed twice',
        ),
        (
            '[router]\nmax_body = "16 megs"\n',
            'router.max_body: expected a size such as "24G" or "512M" (K, M, G, T: powers of 1024), '
            'got "16 megs"',
        ),
        ("[router]\nmax_body = 10\n", "router.max_body: must be from 1K to 4G, got 10"),
        (
            "[router]\nidle_timeout_s = 0\n",
            "router.idle_timeout_s: must be from 1 to 604800 seconds, got 0",
        ),
        (
            "[router]\nidle_timeout_s = nan\n",
            "router.idle_timeout_s: must be from 1 to 604800 seconds, got nan",
        ),
        (
            "[router]\nidle_timeout_s = true\n",
            "router.idle_timeout_s: expected a number of seconds from 1 to 604800, got true",
        ),
        ("[gpu]\nheadroom_gb = -1\n", "gpu.headroom_gb: must be from 0 to 1024 GB, got -1"),
        ("router = 1\n", "router: expected a table [router], got a value"),
    ],
)
def test_bad_values_are_one_line_each(text: str, line: str) -> None:
    assert problems(text) == [f"/etc/providerd/providerd.toml: {line}"]


def test_not_toml_is_one_problem(tmp_path: Path) -> None:
    path = tmp_path / "providerd.toml"
    path.write_text("[router\n")
    with pytest.raises(config.ConfigError) as e:
        config.load(path)
    [problem] = e.value.problems
    assert str(problem).startswith(f"{path}: is not valid TOML: ")
    assert "\n" not in str(problem)


def test_an_unreadable_file_is_a_problem(tmp_path: Path) -> None:
    with pytest.raises(config.ConfigError) as e:
        config.load(tmp_path)  # a directory
    assert str(e.value.problems[0]).startswith(f"{tmp_path}: ")


def test_the_router_drop_in_replaces_the_default_address() -> None:
    settings = Config(
        router=RouterConfig(
            addresses=(Address("::1", 9100), Address(None, None, "/run/x%y.sock")), enabled=False
        ),
        source=Path("/etc/providerd/providerd.toml"),
    )
    assert router_units.render_router(settings) == {
        "providerd-router.socket.d/50-config.conf": (
            "# Generated by providerd-generator from /etc/providerd/providerd.toml; "
            "edit that file, not this one.\n"
            "[Socket]\n"
            "ListenStream=\n"
            "ListenStream=[::1]:9100\n"
            "ListenStream=/run/x%%y.sock\n"
        )
    }
    enabled = router_units.render_router(Config(router=RouterConfig(enabled=True)))
    link = enabled["sockets.target.wants/providerd-router.socket"]
    assert link == generator.units.Link("/lib/systemd/system/providerd-router.socket")


def _log() -> tuple[generator.Log, io.StringIO]:
    buf = io.StringIO()
    return generator.Log(kmsg="/nonexistent/kmsg", fallback=buf), buf


def test_the_generator_writes_the_router_socket_from_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PROVIDERD_MANIFEST_DIRS", str(tmp_path / "none"))
    path = tmp_path / "providerd.toml"
    path.write_text('[router]\nenabled = true\naddress = "127.0.0.1:9200"\n')
    monkeypatch.setenv("PROVIDERD_CONFIG", str(path))
    out = tmp_path / "out"
    log, buf = _log()
    assert generator.main([str(out)], log) == 0
    assert buf.getvalue() == ""
    dropin = out / "providerd-router.socket.d" / "50-config.conf"
    assert "ListenStream=\nListenStream=127.0.0.1:9200\n" in dropin.read_text()
    assert os.readlink(out / "sockets.target.wants" / "providerd-router.socket") == (
        "/lib/systemd/system/providerd-router.socket"
    )


def test_the_generator_without_the_file_writes_nothing_for_the_router(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PROVIDERD_MANIFEST_DIRS", str(tmp_path / "none"))
    monkeypatch.setenv("PROVIDERD_CONFIG", str(tmp_path / "absent.toml"))
    out = tmp_path / "out"
    log, buf = _log()
    assert generator.main([str(out)], log) == 0
    assert buf.getvalue() == ""
    assert not (out / "providerd-router.socket.d").exists()


def test_a_bad_file_is_logged_and_the_boot_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PROVIDERD_MANIFEST_DIRS", str(tmp_path / "none"))
    path = tmp_path / "providerd.toml"
    path.write_text("[router]\nport = 1\n")
    monkeypatch.setenv("PROVIDERD_CONFIG", str(path))
    out = tmp_path / "out"
    log, buf = _log()
    assert generator.main([str(out)], log) == 0
    lines = buf.getvalue().splitlines()
    assert lines[0].endswith(
        f"{path}: router.port: unknown key; known keys: enabled, address, max_body, idle_timeout_s, log_requests"
    )
    assert "providerd-router.socket keeps its default address" in lines[1]
    assert not (out / "providerd-router.socket.d").exists()
