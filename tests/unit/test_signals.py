"""Signal handlers are put back as they were: the helper, `providerctl serve`, the front.

Each test installs a handler of its own first, so that "restored" means exactly that
handler again, not whatever asyncio leaves behind (SIG_DFL)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent import signals
from agent.spec.provider import Address, Provider
from tests.fakes.fake_systemd import FakeSystemd


def before(_sig: int, _frame: types.FrameType | None) -> None:
    raise AssertionError("the handler from before ran while the loop's was installed")


@pytest.fixture
def own_handlers() -> Iterator[None]:
    saved = {sig: signal.signal(sig, before) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


@pytest.fixture
def runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PROVIDERD_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("PROVIDERD_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("PROVIDERD_CONFIG", str(tmp_path / "providerd.toml"))  # none: defaults
    return tmp_path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_the_helper_runs_the_handler_on_the_loop_and_restores_what_was_there(
    own_handlers: None,
) -> None:
    async def go() -> list[int]:
        got: list[int] = []
        loop = asyncio.get_running_loop()
        with signals.handling(loop, {signal.SIGTERM: lambda: got.append(signal.SIGTERM)}):
            assert signal.getsignal(signal.SIGTERM) is not before
            os.kill(os.getpid(), signal.SIGTERM)
            while not got:
                await asyncio.sleep(0.01)
        return got

    assert asyncio.run(go()) == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) is before
    assert signal.getsignal(signal.SIGINT) is before  # never touched


def test_providerctl_serve_restores_the_handlers_when_it_returns(
    own_handlers: None, runtime: Path
) -> None:
    from agent.cli.serve import serve

    p = Provider(
        slug="sig",
        source=runtime / "sig.toml",
        addresses=(Address("127.0.0.1", free_port()),),
        command=("/bin/true",),
    )

    async def go() -> int:
        loop = asyncio.get_running_loop()
        served = loop.create_task(serve([p]))
        while not Path(runtime / "run" / "sig" / "control.sock").exists():
            await asyncio.sleep(0.01)
        assert signal.getsignal(signal.SIGINT) is not before
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C
        return await asyncio.wait_for(served, 10)

    assert asyncio.run(go()) == 0
    assert signal.getsignal(signal.SIGINT) is before
    assert signal.getsignal(signal.SIGTERM) is before


class Bus(FakeSystemd):
    """The fake systemd, connected like the real bus client."""

    async def connect(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_the_activated_front_restores_its_sigterm_handler_when_it_exits(
    own_handlers: None, runtime: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agent.front.front import run_systemd
    from agent.systemd import activation, bus

    manifest = runtime / "sig.toml"
    manifest.write_text(
        '[listen]\naddress = "127.0.0.1:9"\n\n[runtime]\ncommand = ["/opt/m/serve", "{port}"]\n'
    )
    monkeypatch.setenv("PROVIDERD_MANIFEST", str(manifest))
    monkeypatch.setenv("PROVIDERD_TRUSTED_UID", str(os.getuid()))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    monkeypatch.setattr(activation, "inherited_listeners", lambda: [sock])
    monkeypatch.setattr(bus, "DbusSystemd", Bus)

    async def go() -> int:
        loop = asyncio.get_running_loop()
        front = loop.create_task(run_systemd("sig"))
        while not Path(runtime / "run" / "sig" / "control.sock").exists():
            await asyncio.sleep(0.01)
        assert signal.getsignal(signal.SIGTERM) is not before
        os.kill(os.getpid(), signal.SIGTERM)  # systemctl stop
        return await asyncio.wait_for(front, 10)

    assert asyncio.run(go()) == 0
    assert signal.getsignal(signal.SIGTERM) is before
    sock.close()


def test_the_router_restores_its_sigterm_handler_when_it_exits(
    own_handlers: None, runtime: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agent.router.router import run_systemd
    from agent.systemd import activation

    (runtime / "providers").mkdir()
    monkeypatch.setenv("PROVIDERD_MANIFEST_DIRS", str(runtime / "providers"))
    monkeypatch.setenv("PROVIDERD_KEYS", str(runtime / "keys.toml"))  # none: keys off
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    monkeypatch.setattr(activation, "inherited_listeners", lambda _unit: [sock])

    async def go() -> int:
        router = asyncio.create_task(run_systemd())
        while signal.getsignal(signal.SIGTERM) is before:
            await asyncio.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)  # systemctl stop
        return await asyncio.wait_for(router, 10)

    assert asyncio.run(go()) == 0
    assert signal.getsignal(signal.SIGTERM) is before
    assert signal.getsignal(signal.SIGHUP) is not None
    sock.close()
