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
# A line each way: room for a keys push of apikeys.MAX_KEYS keys (about 140 KB).
MAX_LINE = 1024 * 1024


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
            while True:
                try:
                    line = await reader.readline()
                except ValueError:  # over the reader's limit: answered, then closed
                    writer.write(_line({"error": f"request longer than {MAX_LINE} bytes"}))
                    await writer.drain()
                    break
                if not line:
                    break
                try:
                    request = json.loads(line)
                    if not isinstance(request, dict):
                        raise ValueError("expected a JSON object")
                    request["peer_uid"] = peer_uid
                    answer = await handler(request)
                except (ValueError, KeyError, TypeError) as e:
                    answer = {"error": f"bad request: {e}"}
                writer.write(_line(answer))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
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
    """One request, blocking; raises RpcError when nobody answers as they should."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(str(path))
            s.sendall(_line(request))
            data = bytearray()
            while not data.endswith(b"\n") and len(data) <= MAX_LINE:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
    except OSError as e:
        raise _failed(e) from None
    return _answer(bytes(data))


async def acall(path: Path, request: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
    """One request from inside an event loop: the same exchange as `call`."""
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_unix_connection(str(path), limit=MAX_LINE), timeout
        )
    except OSError as e:  # TimeoutError too
        raise _failed(e) from None
    data = _line(request)
    try:
        writer.write(data)
        line = await asyncio.wait_for(reader.readline(), timeout)
    except OSError as e:
        raise _failed(e) from None
    except ValueError:  # longer than the reader's limit
        raise RpcError(TOO_LONG) from None
    finally:
        writer.close()
    return _answer(line)


# -- what both ways share: the framing, the encoding and what their failures mean

TOO_LONG = f"answered a line longer than {MAX_LINE} bytes"


def _line(request: dict[str, Any]) -> bytes:
    return json.dumps(request).encode() + b"\n"


def _answer(line: bytes) -> dict[str, Any]:
    """The answer in `line` (what came before the end of the line or of the connection)."""
    if not line:
        raise RpcError("closed the connection without answering")
    if len(line) > MAX_LINE:
        raise RpcError(TOO_LONG)
    try:
        answer = json.loads(line)
    except ValueError:
        raise RpcError("answered something that is not JSON") from None
    if not isinstance(answer, dict):
        raise RpcError("answered something that is not a JSON object")
    return answer


def _failed(e: OSError) -> RpcError:
    """What a failure to connect, send or receive means."""
    if isinstance(e, FileNotFoundError):
        return NotRunning("not running")
    if isinstance(e, ConnectionRefusedError):
        return NotRunning("not running (stale control socket)")
    return RpcError(str(e) or "timed out")
