"""The one table of manifest keys.

Each `Key` says what a `provider.toml` key is: its type, its default, what it
means, the accepted range or choices, and the systemd directive it becomes.
`agent.spec.manifest` validates against this table (unknown keys, kinds, ranges),
and the reference in docs/manifest.md and the man page provider.toml(5) are
generated from it (`python3 -m agent.spec.keys --markdown` / `--man`); a test keeps
both files equal to what this module prints. `Key.becomes` names the directives a key is
rendered as: agent.systemd.units takes its directive names from there, and
tests/unit/test_keys_render.py checks that the reference documents the ones rendered.
No I/O except in `main`.

Long for a reason: it is the table of every key with its reference text, read top to
bottom like the reference it prints.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

# Kinds the validator knows (agent.spec.values.CONVERTERS has one function per kind).
KINDS = (
    "string",
    "bool",
    "addresses",
    "choice",
    "cidrs",
    "int",
    "seconds",
    "argv",
    "entrypoint",
    "ready",
    "environment",
    "abspath",
    "abspaths",
    "urlpaths",
    "size",
    "percent",
    "gpu_devices",
    "gigabytes",
    "names",
    "regexes",
    "credentials",
    "filemode",
    "group",
)

# The drop-ins a key may become directives of (agent.systemd.units renders one of each).
UNIT_ROLES = ("socket", "front", "worker")

SECTIONS = ("", "listen", "runtime", "limits", "gpu", "weights", "isolation", "models")

SECTION_MEANING = {
    "": "Top-level keys.",
    "listen": "Where clients connect. PID 1 holds these addresses from boot (the socket unit).",
    "runtime": "The worker: the model's own server, started on the first request and stopped when idle.",
    "limits": "Resource limits of the worker's cgroup. Absent keys mean no limit.",
    "gpu": "GPU use. Without this table the provider uses no GPU.",
    "weights": "Model files the worker reads.",
    "isolation": "How the worker is separated from the host.",
    "models": "The model names this provider answers to behind the router (one endpoint for many models).",
}


@dataclass(frozen=True)
class Key:
    section: str  # "" for top-level keys
    name: str
    kind: str  # one of KINDS
    type: str  # the type as a person reads it
    default: str  # the default as written in TOML; "" when required
    meaning: str
    directive: str = (
        ""  # the systemd directive and unit it becomes, in words; "" when read by providerd itself
    )
    low: float | None = None  # accepted range, inclusive
    high: float | None = None
    choices: tuple[str, ...] = ()
    required: bool = False
    # What the renderer writes for this key, as (unit, directive): unit is one of UNIT_ROLES,
    # or "link" with the .wants directory the generator links into. agent.systemd.units takes
    # its directive names from here; a test checks `directive` names the same ones.
    becomes: tuple[tuple[str, str], ...] = ()

    @property
    def dotted(self) -> str:
        return f"{self.section}.{self.name}" if self.section else self.name

    def range_text(self) -> str:
        """The accepted range in words, as used in messages and docs."""
        if self.choices:
            return "one of " + ", ".join(f'"{c}"' for c in self.choices)
        if self.low is None and self.high is None:
            return ""
        return f"{_num(self.low)} to {_num(self.high)}"


def _num(value: float | None) -> str:
    if value is None:
        return "?"
    return str(int(value)) if float(value).is_integer() else str(value)


MAX_TIMEOUT_S = 7 * 24 * 3600.0

KEYS: tuple[Key, ...] = (
    Key(
        "",
        "description",
        "string",
        "string",
        '""',
        "What the provider serves; shown by `providerctl status` and in the units' Description.",
    ),
    Key(
        "",
        "enabled",
        "bool",
        "boolean",
        "true",
        "Listen from boot: the generator links the socket into sockets.target.",
        "sockets.target.wants/provider@SLUG.socket link",
        becomes=(("link", "sockets.target.wants"),),
    ),
    Key(
        "listen",
        "address",
        "addresses",
        "string or list of strings",
        "",
        'Where clients connect: "host:port", "[v6]:port" or an absolute unix socket path. '
        "No two providers may share an address.",
        "ListenStream= (socket)",
        becomes=(("socket", "ListenStream"),),
        required=True,
    ),
    Key(
        "listen",
        "protocol",
        "choice",
        "string",
        '"http"',
        '"http": request-aware (leases per request, 503 with a JSON body while a start fails); '
        '"tcp": opaque bytes (a connection is a lease).',
        choices=("http", "tcp"),
    ),
    Key(
        "listen",
        "allow",
        "cidrs",
        "list of strings",
        "[]",
        'Client allow-list: addresses or CIDRs ("10.0.0.0/8", "::1"). Empty: anyone may connect.',
        "IPAddressDeny=any + IPAddressAllow= (socket)",
        becomes=(("socket", "IPAddressDeny"), ("socket", "IPAddressAllow")),
    ),
    Key(
        "listen",
        "max_held",
        "int",
        "integer",
        "1024",
        "Requests held in the front (while the worker starts, and beyond "
        "runtime.max_concurrency); beyond this, new ones are refused at once (503, Retry-After).",
        low=1,
        high=1_000_000,
    ),
    Key(
        "runtime",
        "mode",
        "choice",
        "string",
        '"resident"',
        '"resident": the worker stays up until the provider has been idle for idle_timeout_s.',
        choices=("resident",),
    ),
    Key(
        "runtime",
        "command",
        "argv",
        "list of strings",
        "",
        "The worker's command as argv, with placeholders {port}, {host}, {slug}, {python} "
        "({{ and }} for literal braces). Exactly one of command and launch.",
        "ExecStart= (worker), placeholders filled (after the wrapper python3 -m agent.worker "
        "when there are credentials)",
        becomes=(("worker", "ExecStart"),),
    ),
    Key(
        "runtime",
        "launch",
        "entrypoint",
        "string",
        "",
        '"package.module:function" returning the argv; resolved by the worker wrapper when the '
        "worker starts, as the worker's user. Exactly one of command and launch.",
        "ExecStart= (worker), as --launch",
        becomes=(("worker", "ExecStart"),),
    ),
    Key(
        "runtime",
        "worker_port",
        "int",
        "integer",
        "0",
        "The worker's private TCP port ({port}); 0: 8000 inside the provider's private network, "
        'or with network = "host" a free one the front chooses at each start.',
        low=0,
        high=65535,
    ),
    Key(
        "runtime",
        "ready",
        "ready",
        "string",
        '"tcp"',
        'When the model answers: "tcp" (the port accepts), "http:/path" (GET answers 2xx), or '
        '"notify" (the model sends READY=1 itself).',
        'Type= (worker): exec, or notify for "notify" (a `launch` or `credentials` '
        "worker runs the wrapper, which takes it as --ready)",
        becomes=(("worker", "Type"),),
    ),
    Key(
        "runtime",
        "environment",
        "environment",
        "table of strings",
        "{}",
        "Environment of the worker, passed unchanged ($ and % included).",
        "Environment= (worker)",
        becomes=(("worker", "Environment"),),
    ),
    Key(
        "runtime",
        "working_directory",
        "abspath",
        "string (absolute path)",
        "the manifest's directory for SLUG/provider.toml, else /",
        "The worker's working directory.",
        "WorkingDirectory= (worker)",
        becomes=(("worker", "WorkingDirectory"),),
    ),
    Key(
        "runtime",
        "start_timeout_s",
        "seconds",
        "number (seconds)",
        "900",
        "How long the worker may take to become ready.",
        "TimeoutStartSec= (worker)",
        becomes=(("worker", "TimeoutStartSec"),),
        low=1,
        high=MAX_TIMEOUT_S,
    ),
    Key(
        "runtime",
        "request_timeout_s",
        "seconds",
        "number (seconds)",
        "300",
        "How long a request proxied to the worker may go without a byte of its response: to the "
        "first byte and between bytes (a stream may run longer as long as it keeps producing).",
        low=1,
        high=MAX_TIMEOUT_S,
    ),
    Key(
        "runtime",
        "idle_timeout_s",
        "seconds",
        "number (seconds)",
        "600",
        "With no request in flight for this long, the front exits and systemd stops the worker.",
        low=1,
        high=MAX_TIMEOUT_S,
    ),
    Key(
        "runtime",
        "stop_timeout_s",
        "seconds",
        "number (seconds)",
        "30",
        "How long requests in flight may take to finish when the provider is stopped.",
        "TimeoutStopSec= (front, plus 30 s)",
        becomes=(("front", "TimeoutStopSec"),),
        low=1,
        high=3600,
    ),
    Key(
        "runtime",
        "idle_ignore_paths",
        "urlpaths",
        "list of strings",
        "[]",
        'HTTP paths (such as "/health") whose requests do not keep the provider busy.',
    ),
    Key(
        "runtime",
        "keyless_idle_ignore_paths",
        "bool",
        "boolean",
        "false",
        "With API keys on (/etc/providerd/keys.toml), let requests to `idle_ignore_paths` "
        "through without a key. Such a request still starts the model if it is not running.",
    ),
    Key(
        "runtime",
        "pinned",
        "bool",
        "boolean",
        "false",
        "Keep the worker once it runs: never released when idle, never retired to make room "
        "on a GPU. It still stops on `providerctl stop`, a crash, or its VRAM budget.",
    ),
    Key(
        "runtime",
        "preload",
        "bool",
        "boolean",
        "false",
        "Load the model when the system starts, after its socket, instead of on the first "
        "request. Needs enabled = true. Unless pinned, it is released when idle like any other.",
        "multi-user.target.wants/provider@SLUG.service link",
        becomes=(("link", "multi-user.target.wants"),),
    ),
    Key(
        "limits",
        "memory_max",
        "size",
        'size ("32G", "512M")',
        "no limit",
        "Hard memory limit of the worker; over it, the kernel kills the worker.",
        "MemoryMax= (worker)",
        becomes=(("worker", "MemoryMax"),),
    ),
    Key(
        "limits",
        "memory_high",
        "size",
        'size ("28G")',
        "no limit",
        "Memory above which the worker is throttled and reclaimed; at most memory_max.",
        "MemoryHigh= (worker)",
        becomes=(("worker", "MemoryHigh"),),
    ),
    Key(
        "limits",
        "cpu_quota",
        "percent",
        'percentage ("400%")',
        "no limit",
        "CPU time, 100% = one CPU; at most the host's CPUs times 100%.",
        "CPUQuota= (worker)",
        becomes=(("worker", "CPUQuota"),),
    ),
    Key(
        "limits",
        "tasks_max",
        "int",
        "integer",
        "no limit",
        "Most processes and threads the worker may have.",
        "TasksMax= (worker)",
        becomes=(("worker", "TasksMax"),),
        low=1,
        high=4_194_304,
    ),
    Key(
        "gpu",
        "devices",
        "gpu_devices",
        "string or list",
        '"none" without [gpu], "auto" with it',
        '"auto" (the card(s) with enough free memory), "none", or a list of indices (0, 1) '
        'or UUIDs ("GPU-…"). The choice reaches the worker as CUDA_VISIBLE_DEVICES.',
        "DeviceAllow= (worker, set by the front at each start)",
        becomes=(("worker", "DeviceAllow"),),
    ),
    Key(
        "gpu",
        "count",
        "int",
        "integer",
        "1",
        "How many cards the worker gets.",
        low=1,
        high=64,
    ),
    Key(
        "gpu",
        "vram_budget_gb",
        "gigabytes",
        "number (GB)",
        "none",
        "GPU memory the worker needs (the larger of this and the measured peak is reserved).",
        low=0.001,
        high=100_000,
    ),
    Key(
        "gpu",
        "enforce",
        "choice",
        "string",
        '"stop"',
        'Over budget: "stop" the worker with a journal line giving the numbers, or "warn".',
        choices=("stop", "warn"),
    ),
    Key(
        "gpu",
        "priority",
        "int",
        "integer",
        "0",
        "To make room on a GPU for this provider, admission retires only idle providers whose "
        "priority is not above this one's: lowest priority first, least recently used first "
        "among equals. A provider of higher priority is never retired for it.",
        low=-1000,
        high=1000,
    ),
    Key(
        "weights",
        "paths",
        "abspaths",
        "list of strings (absolute paths)",
        "[]",
        "Model files or directories; they must exist and are bound read-only into the worker.",
        "BindReadOnlyPaths= (worker)",
        becomes=(("worker", "BindReadOnlyPaths"),),
    ),
    Key(
        "isolation",
        "network",
        "choice",
        "string",
        '"private"',
        '"private": front and worker share a private network namespace, the worker is '
        'reachable only by its front; "host": the worker uses the host network, listening on '
        "its own loopback address ({host}) and denied every other loopback address.",
        "PrivateNetwork= (front and worker)",
        becomes=(("front", "PrivateNetwork"), ("worker", "PrivateNetwork")),
        choices=("private", "host"),
    ),
    Key(
        "models",
        "names",
        "names",
        "list of strings",
        "[]",
        "Exact model names this provider serves, each at most 256 characters without spaces; "
        "no two providers may claim one name.",
    ),
    Key(
        "models",
        "patterns",
        "regexes",
        "list of strings (regular expressions)",
        "[]",
        "Regular expressions a model name must match in full; a pattern may not match "
        "another provider's exact name. At most 256 characters, and only the regular part "
        "of Python's syntax (no back-references, look-arounds, \\b or inline flags), so "
        "that every match takes time linear in the name.",
    ),
    Key(
        "runtime",
        "max_concurrency",
        "int",
        "integer",
        "4",
        "Requests in flight to the worker at once (and connections open to it); later ones wait "
        "in the front in arrival order, counted in `waiting` and bounded by listen.max_held. "
        "4 suits servers with a small accept queue (Python's backlog of 5, llama-server's "
        "--parallel 4); raise it for servers that batch many requests (vLLM). "
        'Upgraded connections (WebSocket) leave the count once switched; protocol = "tcp" '
        "connections are not counted.",
        low=1,
        high=100_000,
    ),
    Key(
        "runtime",
        "credentials",
        "credentials",
        "table of strings (absolute paths)",
        "{}",
        'Secrets, by name: { HF_TOKEN = "/etc/providerd/credentials/hf" }. systemd reads each file '
        "when the worker starts and gives it to the worker alone, as $CREDENTIALS_DIRECTORY/NAME; "
        "the wrapper also sets NAME to the file's text (one trailing newline dropped) in the "
        "model's environment. Never in Environment=, systemctl show or the generated files. The "
        "files must exist; keep them root's, mode 0600.",
        "LoadCredential= (worker)",
        becomes=(("worker", "LoadCredential"),),
    ),
    Key(
        "listen",
        "socket_mode",
        "filemode",
        'string (octal, "0660")',
        '"0660"',
        "Access mode of unix socket addresses.",
        "SocketMode= (socket, unix addresses only)",
        becomes=(("socket", "SocketMode"),),
    ),
    Key(
        "listen",
        "socket_group",
        "group",
        "string (a group name)",
        '"providerd-clients"',
        "Group of unix socket addresses: with the default mode its members may connect (the "
        "router is one). The group must exist.",
        "SocketGroup= (socket, unix addresses only)",
        becomes=(("socket", "SocketGroup"),),
    ),
)

BY_DOTTED: dict[str, Key] = {k.dotted: k for k in KEYS}


def becomes(dotted: str, unit: str) -> tuple[str, ...]:
    """The directives (for unit "link": the .wants directory) the key `dotted` becomes in
    `unit`, in the table's order; KeyError when the table says it becomes none there."""
    found = tuple(d for role, d in BY_DOTTED[dotted].becomes if role == unit)
    if not found:
        raise KeyError(f"{dotted} becomes nothing in the {unit} unit")
    return found


def section_keys(section: str) -> list[Key]:
    return [k for k in KEYS if k.section == section]


# -- the reference, as Markdown and as roff ---------------------------------------------

_INTRO = (
    "A provider is declared once, in `/etc/providerd/providers/SLUG.toml` or "
    "`/etc/providerd/providers/SLUG/provider.toml` (vendor defaults in "
    "`/usr/lib/providerd/providers/`; the same slug in /etc wins; `PROVIDERD_MANIFEST_DIRS`, "
    "colon-separated, replaces both). The slug is the file or directory name: lowercase "
    "letters, digits and `_`, at most 48 characters. Manifests run commands on the host: the "
    "file, its `SLUG/` directory and the manifest directory must be owned by root (or by the uid "
    "in `PROVIDERD_TRUSTED_UID`, which tests set to their own) and must not be writable by group "
    "or others (a sticky directory such as /tmp is accepted). Unknown keys are errors. "
    "`providerctl check` prints every problem, one line "
    "each; the generator skips a manifest with problems and generates all others. Whatever a "
    "file holds or is (a regular file of at most 1 MiB is expected; deep nesting, huge numbers, "
    "a FIFO, a symlink loop or a name that is not UTF-8 are refused), it costs only itself. "
    "No value can add a line to a unit: the generator refuses any value that would carry a "
    "control character or a trailing `\\` into one."
)


_APPLY = (
    (
        "What the generator writes",
        "At boot and on every `systemctl daemon-reload`, providerd-generator writes, for each valid "
        "manifest, drop-ins named `50-manifest.conf` for `provider@SLUG.socket`, `provider@SLUG.service` "
        "and `provider-worker@SLUG.service` (each headed by the manifest it came from, with "
        "`SourcePath=`), a `sockets.target.wants/provider@SLUG.socket` link when `enabled = true`, and "
        "`providerd.json`, the list of what it generated. A manifest with problems is skipped and each "
        "problem is logged to the kernel log (`journalctl -k`); all other providers are generated. "
        "`providerctl generate --dry-run` prints the same files without writing them and verifies them "
        "with `systemd-analyze verify` where it is installed.",
    ),
    (
        "Applying changes",
        "`providerctl reload` checks the manifests, stops the socket and front of providers whose "
        "manifest was removed, runs `systemctl daemon-reload`, starts the sockets of new or newly "
        "enabled providers, and restarts active sockets whose address changed (a reload alone leaves "
        "them closed; the restart also restarts an active front). A manifest with problems is reported "
        "and skipped, the others are reloaded, and the exit status is 1; a provider that was running "
        "and whose manifest now has problems is left running, never stopped for a typo. A provider "
        "that became disabled is left running. Other changes apply at the provider's next start.",
    ),
)


def markdown() -> str:
    """docs/manifest.md, generated from KEYS."""
    out = [
        "# provider.toml — manifest reference",
        "",
        "<!-- Generated by `python3 -m agent.spec.keys --markdown`; do not edit. -->",
        "",
        _INTRO,
        "",
    ]
    for section in SECTIONS:
        keys = section_keys(section)
        out.append(f"## [{section}]" if section else "## Top level")
        out.append("")
        out.append(SECTION_MEANING[section])
        out.append("")
        out.append("| key | type | default | meaning | becomes |")
        out.append("| --- | --- | --- | --- | --- |")
        for k in keys:
            default = "required" if k.required else k.default or "—"
            meaning = k.meaning
            rng = k.range_text()
            if rng and not k.choices:
                meaning += f" Range: {rng}."
            cells = [f"`{k.name}`", k.type, default, meaning, k.directive or "read by providerd"]
            out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        out.append("")
    for title, text in _APPLY:
        out += [f"## {title}", "", text, ""]
    return "\n".join(out)


def _roff(text: str) -> str:
    text = text.replace("\\", "\\e").replace("`", "")
    lines = []
    for line in text.split("\n"):
        if line.startswith((".", "'")):
            line = "\\&" + line
        lines.append(line)
    return "\n".join(lines)


def man() -> str:
    """docs/man/provider.toml.5, generated from KEYS."""
    out = [
        '.\\" Generated by python3 -m agent.spec.keys --man; do not edit.',
        '.TH PROVIDER.TOML 5 "" providerd "File Formats"',
        ".SH NAME",
        "provider.toml \\- providerd provider manifest",
        ".SH SYNOPSIS",
        "/etc/providerd/providers/\\fISLUG\\fR.toml,",
        "/etc/providerd/providers/\\fISLUG\\fR/provider.toml,",
        "/usr/lib/providerd/providers/",
        ".SH DESCRIPTION",
        _roff(_INTRO),
    ]
    for section in SECTIONS:
        out.append(".SH " + (f"[{section.upper()}]" if section else "TOP LEVEL"))
        out.append(_roff(SECTION_MEANING[section]))
        for k in section_keys(section):
            out.append(".TP")
            out.append(f"\\fB{k.name}\\fR ({_roff(k.type)})")
            body = k.meaning
            rng = k.range_text()
            if rng and not k.choices:
                body += f" Range: {rng}."
            body += " Required." if k.required else f" Default: {k.default or 'none'}."
            if k.directive:
                body += f" Becomes {k.directive}."
            out.append(_roff(body))
    for title, text in _APPLY:
        out += [f".SH {title.upper()}", _roff(text)]
    out += [
        ".SH SEE ALSO",
        "\\fBproviderctl\\fR(8), \\fBsystemd.socket\\fR(5), \\fBsystemd.exec\\fR(5), "
        "\\fBsystemd.resource-control\\fR(5), \\fBsystemd.generator\\fR(7)",
        "",
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["--markdown"]:
        sys.stdout.write(markdown())
        return 0
    if args == ["--man"]:
        sys.stdout.write(man())
        return 0
    sys.stderr.write("usage: python3 -m agent.spec.keys --markdown | --man\n")
    return 2


if __name__ == "__main__":
    sys.exit(main())
