"""`providerctl reload` decisions against a faithful fake of systemctl, and
`providerctl generate --dry-run`.

The fake models what reload relies on: daemon-reload reruns the generator into
the generator directory; an active socket whose ListenStream= changed loses its
listening sockets on daemon-reload until it is restarted; a socket instance with
no drop-in has no Listen setting and refuses to start; `start` of an active unit
does nothing; stopping a front stops its worker (BindsTo=).
"""

from __future__ import annotations

import io
import os
import shutil
from pathlib import Path

import pytest
from cases.harness import values, write

from agent.systemd import generator, reload, units


def manifest_text(port: int, *, enabled: bool = True, command: str = "/opt/m") -> str:
    return (
        f"enabled = {'true' if enabled else 'false'}\n"
        f'[listen]\naddress = "127.0.0.1:{port}"\n[runtime]\ncommand = ["{command}"]\n'
    )


class FakeSystemctl:
    def __init__(self, gen: Path) -> None:
        self.gen = gen
        self.calls: list[str] = []
        self.active: set[str] = set()
        self.listening: dict[str, list[str]] = {}  # socket → addresses it really holds
        self.fail: dict[str, str] = {}  # "verb unit" → error

    def _check(self, what: str) -> None:
        self.calls.append(what)
        if what in self.fail:
            raise reload.SystemdError(self.fail[what])

    def _listen(self, unit: str) -> list[str]:
        dropin = self.gen / f"{unit}.d" / units.DROPIN
        return values(dropin.read_text(), "Socket", "ListenStream") if dropin.exists() else []

    def boot(self) -> None:
        self._generate()
        wants = self.gen / "sockets.target.wants"
        for link in sorted(wants.iterdir()) if wants.exists() else []:
            self.start(link.name)
        self.calls.clear()

    def _generate(self) -> None:
        shutil.rmtree(self.gen, ignore_errors=True)  # systemd empties the directory first
        self.gen.mkdir(parents=True)
        generator.main([str(self.gen)], generator.Log(kmsg="/nonexistent", fallback=io.StringIO()))

    def daemon_reload(self) -> None:
        self._check("daemon-reload")
        self._generate()
        for unit in list(self.listening):
            if self._listen(unit) != self.listening[unit]:
                self.listening[unit] = []  # "not functional until restarted"

    def start(self, unit: str) -> None:
        self._check(f"start {unit}")
        self._start(unit)

    def _start(self, unit: str) -> None:
        if unit in self.active:
            return
        if unit.endswith(".socket"):
            listen = self._listen(unit)
            if not listen:
                raise reload.SystemdError(f"Unit {unit} has no Listen setting. Refusing.")
            self.listening[unit] = listen
        self.active.add(unit)

    def stop(self, unit: str) -> None:
        self._check(f"stop {unit}")
        self.active.discard(unit)
        self.listening.pop(unit, None)
        if unit.startswith("provider@") and unit.endswith(".service"):
            self.active.discard(unit.replace("provider@", "provider-worker@"))

    def restart(self, unit: str) -> None:
        self._check(f"restart {unit}")
        self.active.discard(unit)
        self.listening.pop(unit, None)
        self._start(unit)

    def reload(self, unit: str) -> None:
        self._check(f"reload {unit}")

    def is_active(self, unit: str) -> bool:
        return unit in self.active


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, FakeSystemctl]:
    monkeypatch.setenv("PROVIDERD_TRUSTED_UID", str(os.getuid()))
    mdir = tmp_path / "providers"
    mdir.mkdir()
    monkeypatch.setenv("PROVIDERD_MANIFEST_DIRS", str(mdir))
    monkeypatch.setenv("PROVIDERD_GENERATOR_DIR", str(tmp_path / "generator"))
    return mdir, FakeSystemctl(tmp_path / "generator")


def run(systemd: FakeSystemctl) -> tuple[int, list[str]]:
    out = io.StringIO()
    rc = reload.reload(systemd, out)
    return rc, out.getvalue().splitlines()


def test_new_providers_start_only_when_enabled(env: tuple[Path, FakeSystemctl]) -> None:
    mdir, systemd = env
    write(mdir, "a.toml", manifest_text(9001))
    systemd.boot()
    write(mdir, "b.toml", manifest_text(9002))
    write(mdir, "c.toml", manifest_text(9003, enabled=False))
    rc, lines = run(systemd)
    assert rc == 0
    assert systemd.calls == ["daemon-reload", "start provider@b.socket"]
    assert systemd.listening == {
        "provider@a.socket": ["127.0.0.1:9001"],
        "provider@b.socket": ["127.0.0.1:9002"],
    }
    assert lines == [
        "Reloaded systemd.",
        "Started provider@b.socket (b: new provider).",
        "c: new provider, not enabled; start it with systemctl start provider@c.socket",
    ]


def test_moved_socket_is_restarted_so_it_listens_again(env: tuple[Path, FakeSystemctl]) -> None:
    mdir, systemd = env
    write(mdir, "a.toml", manifest_text(9001))
    systemd.boot()
    write(mdir, "a.toml", manifest_text(9101))
    rc, lines = run(systemd)
    assert rc == 0
    assert systemd.calls == ["daemon-reload", "restart provider@a.socket"]
    assert systemd.listening == {"provider@a.socket": ["127.0.0.1:9101"]}
    assert lines[-1] == "Restarted provider@a.socket (a: address 127.0.0.1:9001 -> 127.0.0.1:9101)."


def test_a_reload_alone_would_leave_a_moved_socket_closed(env: tuple[Path, FakeSystemctl]) -> None:
    """The fake models the systemd behaviour that makes the restart necessary."""
    mdir, systemd = env
    write(mdir, "a.toml", manifest_text(9001))
    systemd.boot()
    write(mdir, "a.toml", manifest_text(9101))
    systemd.daemon_reload()
    assert systemd.listening == {"provider@a.socket": []}


def test_removed_provider_is_stopped_before_the_reload(env: tuple[Path, FakeSystemctl]) -> None:
    mdir, systemd = env
    write(mdir, "a.toml", manifest_text(9001))
    gone = write(mdir, "b.toml", manifest_text(9002))
    systemd.boot()
    systemd.active |= {"provider@b.service", "provider-worker@b.service"}
    gone.unlink()
    rc, lines = run(systemd)
    assert rc == 0
    assert systemd.calls == ["stop provider@b.socket", "stop provider@b.service", "daemon-reload"]
    assert systemd.active == {"provider@a.socket"}
    assert lines == [
        "Stopped provider@b.socket, provider@b.service (b: manifest removed).",
        "Reloaded systemd.",
    ]


def test_a_broken_manifest_never_stops_a_serving_provider(env: tuple[Path, FakeSystemctl]) -> None:
    mdir, systemd = env
    write(mdir, "a.toml", manifest_text(9001))
    write(mdir, "b.toml", manifest_text(9002))
    systemd.boot()
    bad = write(mdir, "a.toml", manifest_text(9001) + "typo = 1\n")
    write(mdir, "c.toml", manifest_text(9003))
    rc, lines = run(systemd)
    assert rc == 1
    assert systemd.calls == ["daemon-reload", "start provider@c.socket"]
    assert "provider@a.socket" in systemd.active
    assert lines == [
        f"{bad}: runtime.typo: unknown key",
        f'Skipping provider "a": 1 problem; run "providerctl check {bad}" for details',
        "Reloaded systemd.",
        "a: manifest has problems; its running units were left alone",
        "Started provider@c.socket (c: new provider).",
    ]


def test_enabling_starts_and_disabling_leaves_running(env: tuple[Path, FakeSystemctl]) -> None:
    mdir, systemd = env
    write(mdir, "a.toml", manifest_text(9001, enabled=False))
    write(mdir, "b.toml", manifest_text(9002))
    systemd.boot()
    assert systemd.active == {"provider@b.socket"}
    write(mdir, "a.toml", manifest_text(9001))
    write(mdir, "b.toml", manifest_text(9002, enabled=False))
    rc, lines = run(systemd)
    assert rc == 0
    assert systemd.calls == ["daemon-reload", "start provider@a.socket"]
    assert systemd.active == {"provider@a.socket", "provider@b.socket"}
    assert "Started provider@a.socket (a: enabled)." in lines
    assert "b: disabled; left running (systemctl stop provider@b.socket stops it)" in lines


def test_changed_configuration_is_reported(env: tuple[Path, FakeSystemctl]) -> None:
    mdir, systemd = env
    write(mdir, "a.toml", manifest_text(9001))
    systemd.boot()
    write(mdir, "a.toml", manifest_text(9001, command="/opt/other"))
    rc, lines = run(systemd)
    assert rc == 0 and systemd.calls == ["daemon-reload"]
    assert lines == [
        "Reloaded systemd.",
        "a: configuration changed; it applies at the next start of the provider "
        "(providerctl stop a applies it now)",
    ]


def test_nothing_changed(env: tuple[Path, FakeSystemctl]) -> None:
    mdir, systemd = env
    write(mdir, "a.toml", manifest_text(9001))
    systemd.boot()
    assert run(systemd) == (0, ["Reloaded systemd."])
    assert systemd.calls == ["daemon-reload"]


def test_first_reload_without_an_index_starts_enabled_sockets(
    env: tuple[Path, FakeSystemctl],
) -> None:
    mdir, systemd = env
    write(mdir, "a.toml", manifest_text(9001))
    rc, _ = run(systemd)
    assert rc == 0 and systemd.calls == ["daemon-reload", "start provider@a.socket"]


def test_systemd_failures_are_reported_and_exit_1(env: tuple[Path, FakeSystemctl]) -> None:
    mdir, systemd = env
    write(mdir, "a.toml", manifest_text(9001))
    systemd.boot()
    write(mdir, "b.toml", manifest_text(9002))
    systemd.fail["start provider@b.socket"] = "Address already in use"
    rc, lines = run(systemd)
    assert rc == 1
    assert lines == [
        "Reloaded systemd.",
        "Failed to start provider@b.socket: Address already in use",
    ]
    systemd.fail = {"daemon-reload": "Access denied"}
    assert run(systemd) == (1, ["Failed to reload systemd: Access denied"])


def test_plan_is_pure() -> None:
    pre, post = reload.plan({"gone": {"addresses": ["127.0.0.1:1"], "enabled": True}}, {}, set())
    assert pre == [
        reload.Action(
            "stop", ("provider@gone.socket", "provider@gone.service"), "gone: manifest removed"
        )
    ]
    assert post == []


# -- generate --dry-run ---------------------------------------------------------------------


def test_dry_run_prints_every_file_and_writes_nothing(
    env: tuple[Path, FakeSystemctl], monkeypatch: pytest.MonkeyPatch
) -> None:
    mdir, systemd = env
    write(mdir, "a.toml", manifest_text(9001))
    monkeypatch.setattr(reload, "verify", lambda providers, out: True)
    out = io.StringIO()
    assert reload.dry_run(out) == 0
    text = out.getvalue()
    for path in [
        "provider@a.socket.d/50-manifest.conf",
        "provider@a.service.d/50-manifest.conf",
        "provider-worker@a.service.d/50-manifest.conf",
        "providerd.json",
    ]:
        assert f"---{path}---\n" in text
    assert (
        "---sockets.target.wants/provider@a.socket -> /lib/systemd/system/provider@.socket---\n"
        in text
    )
    assert not systemd.gen.exists()


def test_dry_run_reports_bad_manifests_and_exits_1(
    env: tuple[Path, FakeSystemctl], monkeypatch: pytest.MonkeyPatch
) -> None:
    mdir, _ = env
    write(mdir, "a.toml", manifest_text(9001))
    bad = write(mdir, "b.toml", "[listen]\n")
    monkeypatch.setattr(reload, "verify", lambda providers, out: True)
    out = io.StringIO()
    assert reload.dry_run(out) == 1
    assert (
        f'Skipping provider "b": 2 problems; run "providerctl check {bad}" for details'
        in out.getvalue()
    )
    assert "---provider@a.socket.d/50-manifest.conf---" in out.getvalue()


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed"
)
def test_dry_run_verifies_with_systemd_analyze(env: tuple[Path, FakeSystemctl]) -> None:
    mdir, _ = env
    write(mdir, "a.toml", manifest_text(9001))
    out = io.StringIO()
    assert reload.dry_run(out) == 0, out.getvalue()
    assert out.getvalue().endswith("Verified 3 units with systemd-analyze.\n")


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed"
)
def test_verify_reports_what_systemd_analyze_finds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = tmp_path / "units"
    broken.mkdir()
    for t in ("provider@.socket", "provider-worker@.service"):
        shutil.copyfile(Path(reload.__file__).parents[2] / "units" / t, broken / t)
    (broken / "provider@.service").write_text(
        "[Service]\nType=notify\nExecStart=relative/path %i\n"
    )
    monkeypatch.setattr(reload, "templates_dir", lambda: broken)
    from agent.spec.provider import Address, Provider

    p = Provider(
        slug="x",
        source=tmp_path / "x.toml",
        addresses=(Address("127.0.0.1", 9),),
        command=("/bin/true",),
    )
    out = io.StringIO()
    assert reload.verify([p], out) is False
    assert out.getvalue().startswith("Failed to verify the generated units")


def test_the_router_rereads_manifests_only_when_they_changed(
    env: tuple[Path, FakeSystemctl],
) -> None:
    mdir, systemd = env
    (mdir / "one.toml").write_text(manifest_text(9101))
    systemd.boot()
    systemd.active.add(units.ROUTER_SERVICE)
    assert run(systemd)[0] == 0
    assert f"reload {units.ROUTER_SERVICE}" not in systemd.calls  # nothing changed
    (mdir / "two.toml").write_text(manifest_text(9102))
    code, _ = run(systemd)
    assert code == 0
    assert f"reload {units.ROUTER_SERVICE}" in systemd.calls


def test_router_actions_restart_a_moved_router_socket() -> None:
    actions = reload.router_actions(
        {}, {}, "[Socket]\nListenStream=a\n", "[Socket]\nListenStream=b\n"
    )
    assert [(a.verb, a.units) for a in actions] == [("restart", (reload.ROUTER_SOCKET,))]
