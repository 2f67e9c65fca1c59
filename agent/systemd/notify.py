"""sd_notify(3) in a few lines: tell the service manager what this process is doing.

The manager is systemd (`Type=notify`) or, in foreground mode, the front that started
the worker with a `NOTIFY_SOCKET` of its own. Only the C `_socket` module is imported,
so the worker wrapper can use this on its start path.
"""

from __future__ import annotations

import _socket
import os


def notify(state: str, *, socket_path: str | None = None) -> bool:
    """Send `state` ("READY=1", "STATUS=…", several joined by newlines) as one datagram.

    The address is `socket_path` or else `$NOTIFY_SOCKET`: an absolute path, or an
    abstract address written with a leading `@`. Returns False when there is no such
    socket or the send failed (nobody listening is not an error for the caller).
    """
    address = socket_path if socket_path is not None else os.environ.get("NOTIFY_SOCKET", "")
    if address.startswith("@"):
        address = "\0" + address[1:]
    elif not address.startswith("/"):
        return False  # unset, or a kind of address (vsock) providerd never gets
    try:
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_DGRAM | _socket.SOCK_CLOEXEC)
    except OSError:
        return False
    try:
        sock.sendto(state.encode(), address)
    except OSError:
        return False
    finally:
        sock.close()
    return True
