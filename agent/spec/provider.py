"""The validated form of a provider manifest.

`agent.spec.manifest` turns a `provider.toml` into a `Provider`; everything else
(generator, front, worker wrapper, GPU placement, router) reads only these
immutable objects. No I/O here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

# Re-exported: the worker wrapper imports agent.spec.placeholders alone, to start fast.
from agent.spec.placeholders import PLACEHOLDERS as PLACEHOLDERS
from agent.spec.placeholders import fill_placeholders as fill_placeholders

Protocol = Literal["http", "tcp"]
Enforce = Literal["stop", "warn"]
Network = Literal["private", "host"]


@dataclass(frozen=True)
class Address:
    """One listen address: TCP (v4 or v6) or an absolute unix socket path."""

    host: str | None  # "127.0.0.1", "::1", "0.0.0.0"; None for a unix socket
    port: int | None  # 1..65535; None for a unix socket
    path: str | None = None  # absolute unix socket path

    @property
    def is_unix(self) -> bool:
        return self.path is not None

    def __str__(self) -> str:
        """The form systemd's ListenStream= and the manifest use."""
        if self.path is not None:
            return self.path
        if self.host is not None and ":" in self.host:
            return f"[{self.host}]:{self.port}"
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class Ready:
    """How the worker wrapper knows the model answers."""

    kind: Literal["tcp", "http", "notify"]
    path: str = "/"  # for kind == "http"

    def __str__(self) -> str:
        return f"http:{self.path}" if self.kind == "http" else self.kind


# The worker's port inside a provider's private network namespace, which only its front
# and worker share: fixed, so that systemd can start the worker without asking the front.
PRIVATE_WORKER_PORT = 8000


@dataclass(frozen=True)
class Provider:
    slug: str
    source: Path  # the manifest file it came from
    description: str = ""
    enabled: bool = True

    # [listen]
    addresses: tuple[Address, ...] = ()
    protocol: Protocol = "http"
    allow: tuple[str, ...] = ()  # client allow-list (CIDRs), empty = anyone
    max_held: int = 1024  # connections held while the worker starts; beyond: refused at once
    socket_mode: int = 0o660  # unix socket addresses
    socket_group: str = "providerd-clients"

    # [runtime]
    mode: Literal["resident"] = "resident"
    command: tuple[str, ...] = ()  # argv with placeholders such as {port}; empty when launch is set
    launch: str | None = (
        None  # "package.module:function" returning argv; resolved by the worker wrapper
    )
    worker_port: int = 0  # the worker's private port; 0 = chosen by the front at each start
    ready: Ready = field(default_factory=lambda: Ready("tcp"))
    environment: tuple[tuple[str, str], ...] = ()  # ordered (name, value)
    credentials: tuple[tuple[str, str], ...] = ()  # ordered (name, file path): LoadCredential=
    working_directory: str | None = None
    start_timeout_s: float = 900.0
    request_timeout_s: float = 300.0  # inactivity: to the first response byte, and between bytes
    max_concurrency: int = 4  # requests in flight to the worker at once
    idle_timeout_s: float = 600.0
    stop_timeout_s: float = 30.0  # bounded wait for requests in flight on `providerctl stop`
    idle_ignore_paths: tuple[str, ...] = ()
    keyless_idle_ignore_paths: bool = False  # with API keys on, those paths need no key
    pinned: bool = False  # never released when idle, never retired by GPU admission
    preload: bool = False  # loaded at boot (the front is wanted by multi-user.target)

    # [limits] (None = no limit)
    memory_max: int | None = None  # bytes
    memory_high: int | None = None  # bytes
    cpu_quota: int | None = None  # percent, 100 = one CPU
    tasks_max: int | None = None

    # [gpu]
    gpu_devices: Literal["auto", "none"] | tuple[int | str, ...] = "none"  # indices or "GPU-<uuid>"
    gpu_count: int = 1
    vram_budget_gb: float | None = None
    enforce: Enforce = "stop"
    gpu_priority: int = 0  # admission retires only providers of lower priority

    # [weights]
    weight_paths: tuple[str, ...] = ()  # absolute, bound read-only into the worker

    # [isolation]
    network: Network = "private"

    # [models] (the router)
    model_names: tuple[str, ...] = ()
    model_patterns: tuple[str, ...] = ()  # full-match regular expressions

    @property
    def uses_gpu(self) -> bool:
        return self.gpu_devices != "none"

    @property
    def known_worker_port(self) -> int:
        """The worker's port when it is known before any start: `worker_port`, or in the
        provider's own network namespace a fixed one; 0 when the front picks one per start."""
        if self.worker_port:
            return self.worker_port
        return PRIVATE_WORKER_PORT if self.network == "private" else 0

    @property
    def starts_with_front(self) -> bool:
        """Nothing about the worker's start is decided at run time (no GPU placement, a known
        port): systemd starts it on the front's own activation, beside the front."""
        return not self.uses_gpu and self.known_worker_port != 0


# Control characters: C0, DEL and C1. The one test of "may not hold control characters"
# (values, names, paths) and of what `printable` escapes.
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def has_control(text: str) -> bool:
    return CONTROL.search(text) is not None


def printable(text: str) -> str:
    """`text` safe to print as one line of UTF-8: bytes of a name that are not UTF-8
    (Python's surrogate escapes) and control characters are written as `\\xNN`."""
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate no file name can hold
        raw = text.encode("utf-8", "backslashreplace")
    text = raw.decode("utf-8", "backslashreplace")
    return CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


@dataclass(frozen=True)
class Problem:
    """One thing wrong with one manifest, printed as `<file>: <key>: <message>`."""

    file: str
    key: str  # dotted key, or "" for the file as a whole
    message: str

    def __str__(self) -> str:
        """One printable line, whatever the file's name or the message hold."""
        line = (
            f"{self.file}: {self.key}: {self.message}"
            if self.key
            else f"{self.file}: {self.message}"
        )
        return printable(line)
