"""The control socket's clients: `call` (blocking) and `acall` (in an event loop) make the
same exchange and fail the same way, one clear RpcError, whatever the other end does."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.net import rpc

Serve = Callable[[socket.socket], None]


def answering(data: bytes) -> Serve:
    def serve(conn: socket.socket) -> None:
        conn.recv(65536)
        conn.sendall(data)

    return serve


def silent(conn: socket.socket) -> None:
    conn.recv(65536)
    conn.recv(1)  # until the client gives up


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Callable[[Serve], Path]]:
    made: list[socket.socket] = []

    def make(serve: Serve) -> Path:
        path = tmp_path / f"s{len(made)}.sock"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(path))
        sock.listen(4)
        made.append(sock)

        def run() -> None:
            while True:
                try:
                    conn, _ = sock.accept()
                except OSError:
                    return
                with conn:
                    serve(conn)

        threading.Thread(target=run, daemon=True).start()
        return path

    yield make
    for sock in made:
        sock.shutdown(socket.SHUT_RDWR)
        sock.close()


def both(path: Path, timeout: float = 5.0) -> list[dict[str, object] | str]:
    """What call and acall each give: the answer, or the error's type and message."""
    out: list[dict[str, object] | str] = []
    for way in (
        lambda: rpc.call(path, {"op": "status"}, timeout),
        lambda: asyncio.run(rpc.acall(path, {"op": "status"}, timeout)),
    ):
        try:
            out.append(way())
        except rpc.RpcError as e:
            out.append(f"{type(e).__name__}: {e.message}")
    return out


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b'{"state": "ready"}\n', {"state": "ready"}),
        (b'{"state": "ready"}', {"state": "ready"}),  # closed at the end of the line
        (b"", "RpcError: closed the connection without answering"),
        (b"[1, 2]\n", "RpcError: answered something that is not a JSON object"),
        (b"not json\n", "RpcError: answered something that is not JSON"),
        (b'{"x": "' + b"y" * (rpc.MAX_LINE + 10) + b'"}\n', f"RpcError: {rpc.TOO_LONG}"),
    ],
)
def test_both_clients_read_an_answer_alike(
    server: Callable[[Serve], Path], data: bytes, expected: object
) -> None:
    assert both(server(answering(data))) == [expected, expected]


def test_both_clients_say_a_front_is_not_running_alike(
    tmp_path: Path, server: Callable[[Serve], Path]
) -> None:
    assert both(tmp_path / "none.sock") == ["NotRunning: not running"] * 2
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as gone:
        gone.bind(str(stale))  # the file stays, nobody listens
    assert both(stale) == ["NotRunning: not running (stale control socket)"] * 2
    assert both(server(silent), timeout=0.2) == ["RpcError: timed out"] * 2


def test_the_server_answers_a_request_over_its_limit_and_carries_a_full_keys_push(
    tmp_path: Path,
) -> None:
    """A request longer than MAX_LINE gets an answer that says so (it used to get none);
    a push of the most keys a keys file may hold fits."""
    path = tmp_path / "control.sock"

    async def go() -> tuple[dict[str, object], dict[str, object]]:
        async def handler(request: dict[str, object]) -> dict[str, object]:
            return {"size": len(str(request.get("keys", "")))}

        server = await rpc.serve(path, handler)
        try:
            keys = [
                {"name": f"key-{i:04d}", "sha256": "0" * 64, "providers": ["*"]}
                for i in range(1024)
            ]
            pushed = await rpc.acall(path, {"op": "keys", "keys": keys})
            long = await rpc.acall(path, {"op": "x", "pad": "x" * (rpc.MAX_LINE + 1)})
            return pushed, long
        finally:
            server.close()

    pushed, long = asyncio.run(go())
    assert isinstance(pushed.get("size"), int) and pushed["size"] > 64 * 1024
    assert long == {"error": f"request longer than {rpc.MAX_LINE} bytes"}
