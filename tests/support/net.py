"""Loopback ports and plain HTTP requests (http.client), for every tier."""

from __future__ import annotations

import http.client
import json
import socket
import time
from typing import Any
from urllib.parse import urlsplit


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the kernel's choice)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def accepts(port: int, host: str = "127.0.0.1", timeout: float | None = None) -> bool:
    """Something accepts connections on the port."""
    with socket.socket() as s:
        if timeout is not None:
            s.settimeout(timeout)
        return s.connect_ex((host, port)) == 0


def wait_port(port: int, timeout: float = 20, host: str = "127.0.0.1") -> None:
    """Return once the port accepts; AssertionError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if accepts(port, host):
            return
        time.sleep(0.05)
    raise AssertionError(f"nothing listens on port {port}")


def exchange(
    port: int,
    path: str = "/",
    method: str = "GET",
    body: bytes | None = None,
    timeout: float = 30,
    conn: http.client.HTTPConnection | None = None,
    host: str = "127.0.0.1",
    headers: dict[str, str] | None = None,
) -> tuple[int, http.client.HTTPMessage, bytes]:
    """One request; its status, headers as sent and body. `conn` reuses a connection."""
    c = conn or http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        c.request(method, path, body=body, headers=headers or {})
        r = c.getresponse()
        return r.status, r.headers, r.read()
    finally:
        if conn is None:
            c.close()


def request(
    port: int,
    path: str = "/",
    method: str = "GET",
    body: bytes | None = None,
    timeout: float = 30,
    conn: http.client.HTTPConnection | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """One request; status, headers by lowercase name, body."""
    status, headers, data = exchange(port, path, method, body, timeout, conn)
    return status, {k.lower(): v for k, v in headers.items()}, data


def get(port: int, path: str, timeout: float = 10) -> tuple[int, bytes]:
    status, _, data = exchange(port, path, timeout=timeout)
    return status, data


def get_json(port: int, path: str, timeout: float = 120) -> tuple[int, Any]:
    """GET; the body as JSON (null when empty), or as text when it is not JSON."""
    status, data = get(port, path, timeout)
    try:
        return status, json.loads(data or b"null")
    except ValueError:
        return status, data.decode(errors="replace")


def fetch(url: str, timeout: float = 120) -> dict[str, Any]:
    """GET `url` (http://host:port/path); {"status", "headers", "body"}, or {"status": None,
    "error"} when no answer came (for payloads that report whatever happened as JSON)."""
    parts = urlsplit(url)
    target = parts.path + (f"?{parts.query}" if parts.query else "") or "/"
    try:
        status, headers, data = exchange(
            parts.port or 80, target or "/", timeout=timeout, host=parts.hostname or "127.0.0.1"
        )
    except Exception as e:
        return {"status": None, "error": repr(e)}
    return {"status": status, "headers": dict(headers), "body": data.decode(errors="replace")}
