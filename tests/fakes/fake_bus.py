"""A bus daemon's side of one connection, for the blocking client (agent.systemd.syncbus):
SASL EXTERNAL, then dbus-next's own reading and writing of messages, so that what the
client sends and reads is checked against another implementation of the protocol."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dbus_next._private.unmarshaller import Unmarshaller
from dbus_next.message import Message


class FakeBus:
    """A bus daemon's side of one connection: SASL EXTERNAL, then dbus-next's own reading
    and writing of messages; `answer(message)` gives the replies to send for each call (None: close the connection)."""

    def __init__(
        self,
        path: Path,
        answer: Callable[[Message], list[Message] | None],
        auth: bytes = b"OK 1234\r\n",
    ) -> None:
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(path))
        self.server.listen(1)
        self.answer = answer
        self.auth = auth
        self.calls: list[Message] = []
        self.auth_line = b""
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        with self.server:
            conn, _ = self.server.accept()
        with conn:
            data = b""
            while b"\r\n" not in data:
                data += conn.recv(4096)
            self.auth_line, _, rest = data.partition(b"\r\n")
            conn.sendall(self.auth)
            if not self.auth.startswith(b"OK"):
                return
            while b"BEGIN\r\n" not in rest:
                rest += conn.recv(4096)
            rest = rest.split(b"BEGIN\r\n", 1)[1]
            with conn.makefile("rb") as stream:
                self.serve(conn, _Prefixed(rest, stream))

    def serve(self, conn: socket.socket, stream: _Prefixed) -> None:
        serial = 1000
        while True:
            try:
                message = Unmarshaller(stream).unmarshall()
            except Exception:
                return
            if message is None:
                return
            self.calls.append(message)
            replies = self.answer(message)
            if replies is None:  # the bus goes away without answering
                return
            for out in replies:
                serial += 1
                out.serial = serial
                conn.sendall(bytes(out._marshall()))


class _Prefixed:
    """A stream that yields `prefix` first (bytes read past BEGIN), then `stream`."""

    def __init__(self, prefix: bytes, stream: Any) -> None:
        self.prefix = prefix
        self.stream = stream

    def read(self, n: int) -> bytes:
        if self.prefix:
            out, self.prefix = self.prefix[:n], self.prefix[n:]
            if len(out) < n:
                out += self.stream.read(n - len(out))
            return out
        data: bytes = self.stream.read(n)
        return data
