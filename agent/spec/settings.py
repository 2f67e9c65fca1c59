"""providerd's own settings: `/etc/providerd/providerd.toml` (moved by `PROVIDERD_CONFIG`).

    [router]
    enabled = false                 # providerctl serve runs the router; the generator
                                    # links providerd-router.socket into sockets.target
    address = "127.0.0.1:8100"      # or a list; "[::1]:8100", "/run/providerd-router.sock"
    max_body = "16M"                # request bodies larger than this are answered 413
    idle_timeout_s = 600            # the router's process exits after this long without requests

    [gpu]
    headroom_gb = 1.0               # VRAM kept free on a card beyond a provider's need

A missing file means the defaults. Parsing is strict like the manifests': an unknown
table or key, or a value of the wrong kind, is a `Problem` printed as
`<file>: <key>: <message>`. The file gets the manifests' checks too: a regular file
(opened without blocking), at most 64 KiB, owned by root and writable by nobody else.
`parse` is pure; `load` reads the file and raises nothing but `ConfigError`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from agent.spec import paths
from agent.spec.files import FileProblem, contained, mode_problems, read_regular
from agent.spec.provider import Address, Problem
from agent.spec.values import (
    Invalid,
    did_you_mean,
    expect_bool,
    load_toml,
    parse_address,
    quote,
    size_bytes,
    unknown_table,
)
from agent.systemd.units import UNIT_DIR, Link, assignment, comment

ROUTER_SOCKET = "providerd-router.socket"
ROUTER_DROPIN = "50-config.conf"
ROUTER_SOCKET_UNIT = f"{UNIT_DIR}/{ROUTER_SOCKET}"
DEFAULT_ROUTER_ADDRESS = Address("127.0.0.1", 8100)
DEFAULT_MAX_BODY = 16 << 20
MIB = 1 << 20
GIB = 1 << 30
MAX_CONFIG_BYTES = 64 << 10
CONFIG_DECIDES = "providerd.toml decides where providerd listens"


@dataclass(frozen=True)
class RouterConfig:
    enabled: bool = False
    addresses: tuple[Address, ...] = (DEFAULT_ROUTER_ADDRESS,)
    max_body: int = DEFAULT_MAX_BODY  # bytes
    idle_timeout_s: float = 600.0


@dataclass(frozen=True)
class GpuConfig:
    headroom_gb: float = 1.0

    @property
    def headroom_bytes(self) -> int:
        return int(self.headroom_gb * GIB)


@dataclass(frozen=True)
class Config:
    router: RouterConfig = field(default_factory=RouterConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)
    source: Path | None = None  # the file read; None when it does not exist


class ConfigError(Exception):
    """The settings file cannot be used; `problems` say why, one line each."""

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__("; ".join(str(p) for p in problems))
        self.problems = problems


# -- converters: TOML value → setting, or Invalid with what was expected -------------------


def _addresses(value: object) -> tuple[Address, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(v, str) for v in items) or not items:
        raise Invalid(
            f'expected an address such as "127.0.0.1:8100" or a list of them, got {quote(value)}'
        )
    out: list[Address] = []
    for text in items:
        assert isinstance(text, str)
        try:
            address = parse_address(text)
        except Exception as e:  # Invalid, or whatever else an odd address raises
            raise Invalid(str(e)) from None
        if address in out:
            raise Invalid(f"{quote(text)} is listed twice")
        out.append(address)
    return tuple(out)


def _size(value: object) -> int:
    size = size_bytes(value, "KMG")
    if size is None:
        raise Invalid(
            f'expected a size such as "16M" or "1G" (K, M, G: powers of 1024), got {quote(value)}'
        )
    if not 1024 <= size <= 4 * GIB:
        raise Invalid(f"must be from 1K to 4G, got {quote(value)}")
    return size


def _number(low: float, high: float, unit: str) -> Callable[[object], float]:
    def convert(value: object) -> float:
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise Invalid(f"expected a number{unit}, got {quote(value)}")
        if not low <= value <= high:  # also refuses nan
            raise Invalid(f"must be from {low:g} to {high:g}{unit}, got {quote(value)}")
        return float(value)

    return convert


# (table, key) → (converter, field of the table's dataclass)
_KEYS: dict[tuple[str, str], tuple[Callable[[object], object], str]] = {
    ("router", "enabled"): (expect_bool, "enabled"),
    ("router", "address"): (_addresses, "addresses"),
    ("router", "max_body"): (_size, "max_body"),
    ("router", "idle_timeout_s"): (_number(1, 7 * 86400, " (seconds)"), "idle_timeout_s"),
    ("gpu", "headroom_gb"): (_number(0, 1024, " (GB)"), "headroom_gb"),
}
_TABLES = ("router", "gpu")


def _unknown(table: str, key: str) -> str:
    known = [k for t, k in _KEYS if t == table]
    return f"unknown key{did_you_mean(key, known)}; known keys: {', '.join(known)}"


def parse(raw: bytes, source: Path) -> Config | list[Problem]:
    """The settings in `raw` (the text of `source`), or every problem with them. Pure."""
    file = str(source)
    try:
        data = load_toml(raw, "providerd.toml")
    except Invalid as e:
        return [Problem(file, "", str(e))]
    problems: list[Problem] = []
    values: dict[str, dict[str, object]] = {t: {} for t in _TABLES}
    for table, body in data.items():
        if table not in _TABLES:
            problems.append(Problem(file, table, unknown_table(table, _TABLES)))
            continue
        if not isinstance(body, dict):
            problems.append(Problem(file, table, f"expected a table [{table}], got a value"))
            continue
        for key, value in body.items():
            entry = _KEYS.get((table, key))
            if entry is None:
                problems.append(Problem(file, f"{table}.{key}", _unknown(table, key)))
                continue
            convert, name = entry
            try:
                values[table][name] = convert(value)
            except Invalid as e:
                problems.append(Problem(file, f"{table}.{key}", str(e)))
    if problems:
        return problems
    router = RouterConfig(**values["router"])  # type: ignore[arg-type]
    gpu = GpuConfig(**values["gpu"])  # type: ignore[arg-type]
    return Config(router=router, gpu=gpu, source=source)


def load(path: Path | None = None) -> Config:
    """The settings file (`paths.config_file()` by default); defaults if it does not exist.
    Raises ConfigError."""
    path = path or paths.config_file()
    result = contained(str(path), "providerd.toml", lambda: _load(path))
    if isinstance(result, list):
        raise ConfigError(result)
    return result


def _load(path: Path) -> Config | list[Problem]:
    try:
        raw = read_regular(path, MAX_CONFIG_BYTES, "providerd.toml")
    except FileProblem as e:
        if e.missing:
            return Config()
        return [Problem(str(path), "", e.message)]
    checks = [(path, False), (path.parent, True)]
    problems = mode_problems(path, checks, paths.trusted_uids(), CONFIG_DECIDES)
    result = parse(raw, path)
    if isinstance(result, list):
        return problems + result
    return problems or result


# -- what the generator writes for the router -------------------------------------------------


def _listen_stream(address: Address) -> str:
    return str(address).replace("%", "%%")


def render_router(config: Config) -> dict[str, str | Link]:
    """The generator's files for the router, by path relative to its output directory: the
    socket's drop-in with the configured address(es), and a `sockets.target.wants/` link
    to the socket unit when the router is enabled. Pure; raises units.Unrenderable for
    a value a unit file would not carry as it is."""
    source = config.source or paths.CONFIG
    lines = [
        comment(f"Generated by providerd-generator from {source}; edit that file, not this one."),
        "[Socket]",
        assignment("ListenStream", ""),
        *(assignment("ListenStream", _listen_stream(a)) for a in config.router.addresses),
    ]
    files: dict[str, str | Link] = {f"{ROUTER_SOCKET}.d/{ROUTER_DROPIN}": "\n".join(lines) + "\n"}
    if config.router.enabled:
        files[f"sockets.target.wants/{ROUTER_SOCKET}"] = Link(ROUTER_SOCKET_UNIT)
    return files
