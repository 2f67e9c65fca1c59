"""A request held during a real cold start whose body stops coming gets 408 and no longer
waits; a large body held meanwhile, its client blocked by the front's back-pressure, is not
timed out and reaches the worker whole once it is ready. The front runs in this process
(so that the body limit can be short) with the foreground's worker: a real process that
takes seconds to start."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from pathlib import Path

import pytest

from agent.cli.serve import make_front
from agent.net import sockio
from agent.spec.manifest import parse_bytes
from agent.spec.provider import Provider
from agent.spec.values import this_host
from tests.integration.conftest import free_port, manifest

pytestmark = pytest.mark.integration

START_S = 4.0  # the worker's start: longer than the body limit, several times over
BODY_S = 1.0


def slow_provider(tmp_path: Path) -> Provider:
    text = manifest(free_port(), "--start-delay", str(START_S))
    provider = parse_bytes(text.encode(), tmp_path / "held.toml", "held", this_host())
    assert isinstance(provider, Provider), provider
    return provider


async def response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return int(head.split(b" ")[1]), await reader.readexactly(length)


def test_a_held_body_has_its_limit_during_a_real_cold_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sockio, "BODY_TIMEOUT_S", BODY_S)
    for name, where in (("RUNTIME", "run"), ("STATE", "state")):
        monkeypatch.setenv(f"PROVIDERD_{name}_DIR", str(tmp_path / where))
    provider = slow_provider(tmp_path)
    size = 8 * 1024 * 1024

    async def main() -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        port = sock.getsockname()[1]
        front = make_front(provider, [sock])
        front.start_accepting()
        loop = asyncio.get_running_loop()
        writers: list[asyncio.StreamWriter] = []
        try:
            # The silent one: the head and 10 of its 1000 bytes, then nothing.
            r1, w1 = await asyncio.open_connection("127.0.0.1", port)
            writers.append(w1)
            w1.write(b"POST /a HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n\r\n0123456789")
            # The big one: 8 MiB that the kernel and the front's read-ahead cannot take.
            r2, w2 = await asyncio.open_connection("127.0.0.1", port)
            writers.append(w2)
            w2.write(b"POST /b HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % size)
            w2.write(os.urandom(size))
            draining = asyncio.ensure_future(w2.drain())
            began = loop.time()
            async with asyncio.timeout(3):
                while len(front.waiters) < 2:
                    await asyncio.sleep(0.01)
            status, body = await asyncio.wait_for(response(r1), START_S)
            took = loop.time() - began
            assert status == 408, body
            assert json.loads(body)["error"] == "request_timeout"
            assert BODY_S * 0.9 <= took < START_S, took
            assert await asyncio.wait_for(r1.read(), 3) == b""  # closed
            assert len(front.waiters) == 1  # the silent one waits no more
            assert not draining.done()  # the big one is blocked by the front, not timed out
            status, body = await asyncio.wait_for(response(r2), 20)
            assert status == 200, body
            assert json.loads(body)["body_length"] == size
            assert loop.time() - began >= START_S * 0.9  # it was held for the whole start
            await draining
        finally:
            for w in writers:
                w.transport.abort()
            front.stop_accepting()
            await asyncio.wait_for(front.stop(2.0), 10)

    t0 = time.monotonic()
    asyncio.run(asyncio.wait_for(main(), 40))
    assert time.monotonic() - t0 < 40
