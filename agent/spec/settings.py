"""providerd's own settings: `/etc/providerd/providerd.toml` (moved by `PROVIDERD_CONFIG`).

    [router]
    enabled = false                 # providerctl serve runs the router; the generator
                                    # links providerd-router.socket into sockets.target
    address = "127.0.0.1:8100"      # or a list; "[::1]:8100", "/run/providerd-router.sock"
    max_body = "16M"                # request bodies larger than this are answered 413
    idle_timeout_s = 600            # the router's process exits after this long without requests
    log_requests = false            # true: one journal line per routed request

    [gpu]
    headroom_gb = 1.0               # VRAM kept free on a card beyond a provider's need

A missing file means the defaults. Parsing is strict like the manifests': an unknown
table or key, or a value of the wrong kind, is a `Problem` printed as
`<file>: <key>: <message>`. The file gets the manifests' checks too: a regular file
(opened without blocking), at most 64 KiB, owned by root and writable by nobody else.
`parse` is pure; `load` reads the file and raises nothing but `ConfigError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from agent.errors import ProviderdError
from agent.spec import paths
from agent.spec.files import FileProblem, contained, parse_trusted
from agent.spec.keys import Key
from agent.spec.provider import Address, Problem
from agent.spec.toml_strict import Invalid, did_you_mean, load_toml, unknown_table
from agent.spec.values import CONVERTERS, Host

DEFAULT_ROUTER_ADDRESS = Address("127.0.0.1", 8100)
DEFAULT_MAX_BODY = 16 << 20
GIB = 1 << 30
MAX_CONFIG_BYTES = 64 << 10
CONFIG_DECIDES = "providerd.toml decides where providerd listens"


@dataclass(frozen=True)
class RouterConfig:
    enabled: bool = False
    addresses: tuple[Address, ...] = (DEFAULT_ROUTER_ADDRESS,)
    max_body: int = DEFAULT_MAX_BODY  # bytes
    idle_timeout_s: float = 600.0
    log_requests: bool = False


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


class ConfigError(ProviderdError):
    """The settings file cannot be used; `problems` say why, one line each."""

    code = "invalid_settings"

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__(
            "; ".join(str(p) for p in problems),
            hint="fix providerd.toml (its keys are listed in providerd.toml(5))",
        )
        self.problems = problems


# -- the keys: each a `Key` converted by its kind's converter, as a manifest's are --------------

# key → field of its table's dataclass
_FIELDS = {"address": "addresses"}
KEYS: tuple[Key, ...] = (
    Key(
        "router",
        "enabled",
        "bool",
        "boolean",
        "false",
        "providerctl serve runs the router; the generator links its socket into sockets.target.",
    ),
    Key(
        "router",
        "address",
        "addresses",
        "string or list of strings",
        '"127.0.0.1:8100"',
        'Where the router listens: "host:port", "[v6]:port" or an absolute unix socket path.',
    ),
    Key(
        "router",
        "max_body",
        "size",
        'size ("16M")',
        '"16M"',
        "Request bodies larger than this are answered 413.",
        low=1 << 10,
        high=4 * GIB,
    ),
    Key(
        "router",
        "idle_timeout_s",
        "seconds",
        "number (seconds)",
        "600",
        "The router's process exits after this long without requests.",
        low=1,
        high=7 * 86400,
    ),
    Key(
        "router",
        "log_requests",
        "bool",
        "boolean",
        "false",
        "One line per routed request in the router's journal (method, path, model, provider).",
    ),
    Key(
        "gpu",
        "headroom_gb",
        "gigabytes",
        "number (GB)",
        "1.0",
        "VRAM kept free on a card beyond a provider's need.",
        low=0,
        high=1024,
    ),
)
_KEYS = {(k.section, k.name): k for k in KEYS}
_TABLES = ("router", "gpu")
# Converters read no host facts for these kinds.
_NO_HOST = Host(cpu_count=1, exists=lambda path: False)


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
            spec = _KEYS.get((table, key))
            if spec is None:
                problems.append(Problem(file, f"{table}.{key}", _unknown(table, key)))
                continue
            try:
                field_name = _FIELDS.get(spec.name, spec.name)
                values[table][field_name] = CONVERTERS[spec.kind](value, spec, _NO_HOST)
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
    checks = [(path, False), (path.parent, True)]
    try:
        return parse_trusted(
            path,
            MAX_CONFIG_BYTES,
            "providerd.toml",
            checks,
            CONFIG_DECIDES,
            lambda raw: parse(raw, path),
        )
    except FileProblem as e:
        if e.missing:
            return Config()
        return [Problem(str(path), "", e.message)]
