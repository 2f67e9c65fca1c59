"""The sockets systemd passed a socket-activated service (a front, the router, metrics)."""

from __future__ import annotations

import socket


def inherited_listeners(socket_unit: str = "provider@SLUG.socket") -> list[socket.socket]:
    """The listening sockets systemd passed us, checked to be listening stream sockets.
    Exits (SystemExit) if there are none or one is something else; `socket_unit` is what
    to start instead of the service (the front's, the router's)."""
    from systemd import daemon

    fds = daemon.listen_fds_with_names(unset_environment=True)
    listeners = []
    for fd in sorted(fds):
        if not daemon.is_socket(fd, socket.AF_UNSPEC, socket.SOCK_STREAM, 1):
            raise SystemExit(
                f"File descriptor {fd} is not a listening stream socket, refusing to start"
            )
        listeners.append(socket.socket(fileno=fd))
    if not listeners:
        raise SystemExit(f"No listening socket received; start {socket_unit}, not the service")
    return listeners
