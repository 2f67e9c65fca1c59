"""A listening socket for an address, where no systemd holds it: the foreground mode's
providers and router (`providerctl serve`) and the metrics service's `--listen`."""

from __future__ import annotations

import contextlib
import socket
import stat
from pathlib import Path

from agent.errors import ProviderdError
from agent.spec.provider import Address


class BindError(ProviderdError):
    """An address that cannot be listened on; the message says which and why."""

    code = "bind_failed"


def listen_on(address: Address, backlog: int = socket.SOMAXCONN) -> socket.socket:
    """Bind and listen; a stale unix socket from an earlier run is replaced. Raises
    BindError."""
    if address.path is not None:
        path = Path(address.path)
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(path.lstat().st_mode):
                path.unlink()  # a stale socket from an earlier run
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        target: str | tuple[str, int] = str(path)
    else:
        family = socket.AF_INET6 if address.host and ":" in address.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        target = (address.host or "", address.port or 0)
    try:
        sock.bind(target)
    except OSError as e:
        sock.close()
        raise BindError(f"Failed to listen on {address}: {e.strerror}") from None
    sock.listen(backlog)
    return sock
