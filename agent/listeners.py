"""The accept side of a socket-activated service (a front, the router).

Accepts in batches from the listening sockets and hands each connection over at once,
in the accept callback itself, so whoever decides an idle exit in the same turn of the
event loop already sees it. Stopping is for good: our copies of the sockets are closed
(never `shutdown()`: PID 1 shares them), and what arrives next waits in the kernel's
queue for the next activation.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable


class Listeners:
    def __init__(
        self,
        sockets: list[socket.socket],
        on_connection: Callable[[socket.socket], None],
        log: logging.Logger,
    ) -> None:
        self.sockets = sockets
        self.on_connection = on_connection
        self.log = log
        self.accepting = False

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        for sock in self.sockets:
            sock.setblocking(False)
            loop.add_reader(sock.fileno(), self.accept, sock)
        self.accepting = True

    def stop(self) -> None:
        """Stop accepting for good."""
        if not self.accepting:
            return
        self.accepting = False
        loop = asyncio.get_running_loop()
        for sock in self.sockets:
            loop.remove_reader(sock.fileno())
            sock.close()  # our copy only; never shutdown(): PID 1 shares the socket

    def accept(self, sock: socket.socket) -> None:
        for _ in range(64):
            try:
                conn, _peer = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self.log.warning("Failed to accept connection: %s, ignoring", e)
                return
            conn.setblocking(False)
            if conn.family != socket.AF_UNIX:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.on_connection(conn)
