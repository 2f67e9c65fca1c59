"""The front's control socket: one JSON object per line in, one per line out.

Requests (`op`): "status", "warm", "stop" (with "grace_s"), "retire", "keys".
`providerctl` and other fronts (GPU admission) are the clients. The server adds
`peer_uid` to each request: the connecting process's uid (SO_PEERCRED), for requests
only root may make.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from agent.errors import ProviderdError

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
MAX_LINE = 64 * 1024


class RpcError(ProviderdError):
    """A front's control socket did not answer as it should (the message says how)."""

    code = "control_socket"


class NotRunning(RpcError):
    """Nobody listens on the control socket: the front is not running."""

    code = "not_running"


async def serve(path: Path, handler: Handler) -> asyncio.AbstractServer:
    """Listen on `path` (replacing a stale socket) and answer each line with `handler`."""

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer_uid = -1
        sock = writer.get_extra_info("socket")
        with contextlib.suppress(OSError, AttributeError):
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            peer_uid = struct.unpack("3i", creds)[1]
        try:
            while line := await reader.readline():
                try:
                    request = json.loads(line)
                    if not isinstance(request, dict):
                        raise ValueError("expected a JSON object")
                    request["peer_uid"] = peer_uid
                    answer = await handler(request)
                except (ValueError, KeyError, TypeError) as e:
                    answer = {"error": f"bad request: {e}"}
                writer.write(json.dumps(answer).encode() + b"\n")
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    server = await asyncio.start_unix_server(client, path=str(path), limit=MAX_LINE)
    os.chmod(path, 0o600)
    return server


def call(path: Path, request: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
    """One request, blocking; raises RpcError when nobody answers."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(str(path))
            s.sendall(json.dumps(request).encode() + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
    except FileNotFoundError:
        raise NotRunning("not running") from None
    except ConnectionRefusedError:
        raise NotRunning("not running (stale control socket)") from None
    except OSError as e:
        raise RpcError(str(e)) from None
    if not data:
        raise RpcError("closed the connection without answering")
    answer = json.loads(data)
    if not isinstance(answer, dict):
        raise RpcError("answered something that is not a JSON object")
    return answer


async def acall(path: Path, request: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
    """One request from inside an event loop."""
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_unix_connection(str(path), limit=MAX_LINE), timeout
        )
    except (FileNotFoundError, ConnectionRefusedError):
        raise NotRunning("not running") from None
    except (OSError, TimeoutError) as e:
        raise RpcError(str(e) or "timed out") from None
    try:
        writer.write(json.dumps(request).encode() + b"\n")
        line = await asyncio.wait_for(reader.readline(), timeout)
    except (OSError, TimeoutError) as e:
        raise RpcError(str(e) or "timed out") from None
    finally:
        writer.close()
    if not line:
        raise RpcError("closed the connection without answering")
    answer = json.loads(line)
    if not isinstance(answer, dict):
        raise RpcError("answered something that is not a JSON object")
    return answer
