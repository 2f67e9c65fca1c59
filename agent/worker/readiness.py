"""The front's own look at whether the model answers, beside the worker's start job.

Front and worker share a network namespace (or the host's), so the front can probe the
model the way the worker's probe does (`ready = "tcp"`: a connection succeeds;
`"http:/path"`: `GET /path` answers 2xx) instead of learning it from systemd: the probe's
`READY=1` → PID 1 → the job's end → `JobRemoved` over the bus → the front cost 5-15 ms
measured under systemd 252, a refused loopback connect costs microseconds (~10 us of the
front's CPU, looked at without waiting). Probes start 1 ms apart and grow with the time since the start
(a 500th of it) to 20 ms while nothing accepts: a model that loads in 1 s is seen within
2 ms, one that loads in 10 s within 20 ms, and a long load costs the front under 1% of a
core. While the model answers "not yet", 50 ms apart. `notify` models have nothing to
probe: their `READY=1` is the start job's end.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket

from agent.net.sockio import connect_to
from agent.spec.provider import Address, Ready
from agent.worker.wrapper import reaches_itself

PROBE_FIRST_S = 0.001
PROBE_GROWTH = 1 / 500  # of the time since the start
PROBE_MAX_S = 0.02  # while nothing listens
PROBE_ANSWERED_MAX_S = 0.05  # while the model answers "not yet"
PROBE_TIMEOUT_S = 2.0
HEAD_MAX = 8192


async def answers(address: Address, ready: Ready) -> bool | None:
    """True when the model answers as `ready` says; False when it accepted the connection
    but did not answer yes (yet); None when nothing accepted it."""
    loop = asyncio.get_running_loop()
    try:
        sock = await connected(loop, address)
    except (OSError, TimeoutError):
        return None
    try:
        if ready.kind == "tcp":
            return True
        host = address.host or "127.0.0.1"
        authority = f"[{host}]" if ":" in host else host
        request = (
            f"GET {ready.path} HTTP/1.1\r\nHost: {authority}:{address.port}\r\n"
            "User-Agent: providerd-front\r\nConnection: close\r\n\r\n"
        )
        async with asyncio.timeout(PROBE_TIMEOUT_S):
            await loop.sock_sendall(sock, request.encode())
            head = b""
            while b"\r\n" not in head and len(head) < HEAD_MAX:
                chunk = await loop.sock_recv(sock, HEAD_MAX)
                if not chunk:
                    break
                head += chunk
        parts = head.split(b" ", 2)
        status = parts[1] if len(parts) >= 2 and parts[0].startswith(b"HTTP/") else b""
        ok = len(status) == 3 and status.isdigit() and status[:1] == b"2"
        if ok:  # read what already came, so that closing does not reset the model's side
            with contextlib.suppress(OSError):
                for _ in range(16):
                    if not sock.recv(65536):
                        break
        return ok
    except (OSError, TimeoutError):
        return False
    finally:
        sock.close()


async def connected(loop: asyncio.AbstractEventLoop, address: Address) -> socket.socket:
    """A connection to the model, or OSError (agent.net.sockio.connect_to: no thread pool;
    bench/results/connect.txt: 51 us a connect, accept and close included, where the loop's
    sock_connect takes 73, and its first 4 ms)."""
    host = address.host or "127.0.0.1"
    target = (host, address.port or 0)
    sock = socket.socket(
        socket.AF_INET6 if ":" in host else socket.AF_INET,
        socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC,
    )
    try:
        if host.startswith("127.") and host != "127.0.0.1":
            # A host-network worker's own loopback address: its IP filter admits only
            # connections from it, as the front's own (agent.systemd.units.worker_loopback).
            sock.bind((host, 0))
        await connect_to(loop, sock, target, PROBE_TIMEOUT_S)
        if reaches_itself(sock):
            raise ConnectionRefusedError(errno.ECONNREFUSED, "connected to itself")
    except BaseException:
        sock.close()
        raise
    return sock


async def until_answers(address: Address, ready: Ready) -> None:
    """Return once the model answers; probes until cancelled."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    while True:
        seen = await answers(address, ready)
        if seen:
            return
        elapsed = loop.time() - started
        if seen is None:
            await asyncio.sleep(min(PROBE_MAX_S, max(PROBE_FIRST_S, elapsed * PROBE_GROWTH)))
        else:
            await asyncio.sleep(min(PROBE_ANSWERED_MAX_S, max(PROBE_FIRST_S, elapsed / 10)))
