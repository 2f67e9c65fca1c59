"""`Provider` → the generator's files, and systemd quoting. Pure: no I/O.

The unit logic lives in the static templates under `units/`; per provider the
generator writes only drop-ins (`50-manifest.conf`) and, for enabled providers,
a `sockets.target.wants/` link (and a `multi-user.target.wants/` link to the
front for those that preload). `render` returns them as a mapping from a path
relative to the generator's output directory to the file's text or a `Link`.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import json
import re
from dataclasses import dataclass

from agent.spec.provider import Provider

GENERATOR = "providerd-generator"
DROPIN = "50-manifest.conf"
UNIT_DIR = "/lib/systemd/system"
SOCKET_TEMPLATE = f"{UNIT_DIR}/provider@.socket"
FRONT_TEMPLATE = f"{UNIT_DIR}/provider@.service"
PYTHON = "/usr/bin/python3"
INDEX = "providerd.json"
# agent.spec.paths.backoff_file() at its default place, as a unit specifier.
BACKOFF_FILE = "/run/providerd/%i.backoff"
KEYS_FILE = "/etc/providerd/keys.toml"  # paths.KEYS: its existence turns API keys on
WORKER_ENV_FILE = "/run/providerd/%i/worker.env"  # written by the front before its own start
FRONT_STOP_MARGIN_S = 30  # the front's TimeoutStopSec= is stop_timeout_s plus this
# Hidden from every worker by TemporaryFileSystem= in units/provider-worker@.service (other
# providers' manifests); a working directory below them is bound back in read-only.
HIDDEN_FROM_WORKER = ("/etc/providerd", "/usr/lib/providerd")


@dataclass(frozen=True)
class Link:
    """A symbolic link to `target`."""

    target: str


class Unrenderable(ValueError):
    """A value that a unit file would not carry as it is: a line break would start a new
    directive, a trailing backslash would swallow the next line. The last guard, whatever
    the manifest's checks let through."""

    def __init__(self, directive: str, reason: str) -> None:
        super().__init__(f"cannot be written safely as {directive}: the value {reason}")
        self.directive = directive


# (section, directive, value exactly as written in the file)
Assignment = tuple[str, str, str]

# systemd ends a line at \n, \r and NUL; other control characters have no business in a unit.
_UNSAFE = re.compile(r"[\x00-\x1f\x7f\ud800-\udfff]")


def _check(directive: str, value: str) -> None:
    if m := _UNSAFE.search(value):
        raise Unrenderable(directive, f"holds the control character U+{ord(m.group()):04X}")
    if value.endswith("\\"):
        raise Unrenderable(directive, "ends with '\\', which would continue it onto the next line")
    if value != value.strip(" "):
        raise Unrenderable(directive, "starts or ends with a space, which systemd drops")


def assignment(directive: str, value: str) -> str:
    """`Directive=value` as one line, or Unrenderable if systemd would read it otherwise."""
    _check(f"{directive}=", value)
    return f"{directive}={value}"


def comment(text: str) -> str:
    """`# text` as one line (a comment never continues, but a line break would end it)."""
    _check("a comment", text.replace("\\", "/"))
    return f"# {text}"


def dropin_text(head: str, assignments: list[Assignment]) -> str:
    """A drop-in: the `head` comment, then each section's assignments, in order."""
    lines = [comment(head)]
    section = None
    for sec, directive, value in assignments:
        if sec != section:
            lines += ["", f"[{sec}]"]
            section = sec
        lines.append(assignment(directive, value))
    return "\n".join(lines) + "\n"


def socket_unit(slug: str) -> str:
    return f"provider@{slug}.socket"


def front_unit(slug: str) -> str:
    return f"provider@{slug}.service"


def worker_unit(slug: str) -> str:
    return f"provider-worker@{slug}.service"


# -- quoting -----------------------------------------------------------------------------

_SAFE_WORD = re.compile(r"[A-Za-z0-9_@%+=:,./{}$^~-]+")


_NEEDS_ESCAPE = re.compile(r'[\\"\x00-\x1f\x7f]')


def _c_escape(text: str) -> str:
    if not _NEEDS_ESCAPE.search(text):
        return text
    out = []
    for c in text:
        if c == "\\":
            out.append("\\\\")
        elif c == '"':
            out.append('\\"')
        elif c == "\n":
            out.append("\\n")
        elif c == "\t":
            out.append("\\t")
        elif ord(c) < 0x20 or ord(c) == 0x7F:
            out.append(f"\\x{ord(c):02x}")
        else:
            out.append(c)
    return "".join(out)


def escape_specifiers(text: str) -> str:
    """`%` → `%%`: systemd expands specifiers in almost every value."""
    return text.replace("%", "%%")


def exec_word(word: str) -> str:
    """One argv item for ExecStart=: `%`→`%%`, `$`→`$$`, C-style quoting where needed."""
    word = escape_specifiers(word).replace("$", "$$")
    if _SAFE_WORD.fullmatch(word):
        return word
    return '"' + _c_escape(word) + '"'


def exec_line(argv: list[str]) -> str:
    return " ".join(exec_word(w) for w in argv)


def environment_assignment(name: str, value: str) -> str:
    """The value of one Environment= line: `$` stays literal there, `%` does not."""
    return '"' + _c_escape(escape_specifiers(f"{name}={value}")) + '"'


def _one_line(text: str) -> str:
    return escape_specifiers(" ".join(text.split()))


def _seconds(value: float) -> str:
    return f"{int(value)}s" if float(value).is_integer() else f"{value:g}s"


_SIZE_SUFFIXES = (("E", 60), ("P", 50), ("T", 40), ("G", 30), ("M", 20), ("K", 10))


def format_size(size: int) -> str:
    for suffix, shift in _SIZE_SUFFIXES:
        if size >= 1 << shift and size % (1 << shift) == 0:
            return f"{size >> shift}{suffix}"
    return str(size)


# -- the worker wrapper --------------------------------------------------------------------


def worker_loopback(slug: str) -> str:
    """A host-network worker's own loopback address, 127.A.B.C with A >= 1 (never
    127.0.0.1, where the fronts and the router listen): the worker may use no other
    loopback address (IPAddressDeny=localhost, IPAddressAllow= this), and its front
    connects from it."""
    h = hashlib.sha256(slug.encode()).digest()
    return f"127.{1 + h[0] % 254}.{h[1]}.{1 + h[2] % 254}"


def worker_argv(provider: Provider, python: str = PYTHON) -> list[str]:
    """The worker wrapper's command line (parsed by `agent.worker.wrapper`)."""
    argv = [python, "-m", "agent.worker", "--slug", provider.slug, "--ready", str(provider.ready)]
    for name, _ in provider.credentials:
        argv += ["--credential", name]
    if provider.launch:
        return [*argv, "--launch", provider.launch]
    return [*argv, "--", *provider.command]


# -- drop-ins ------------------------------------------------------------------------------


def _head(provider: Provider) -> str:
    return f"Automatically generated by {GENERATOR} from {provider.source}"


def _unit(provider: Provider, role: str) -> list[Assignment]:
    what = f": {provider.description}" if provider.description else ""
    return [
        ("Unit", "SourcePath", escape_specifiers(str(provider.source))),
        ("Unit", "Description", f"Provider {provider.slug}{_one_line(what)} ({role})"),
    ]


def socket_assignments(provider: Provider) -> list[Assignment]:
    out = _unit(provider, "listener")
    out += [("Socket", "ListenStream", escape_specifiers(str(a))) for a in provider.addresses]
    if any(a.is_unix for a in provider.addresses):
        out.append(("Socket", "SocketMode", f"{provider.socket_mode:04o}"))
        out.append(("Socket", "SocketGroup", escape_specifiers(provider.socket_group)))
    if provider.allow:
        out.append(("Socket", "IPAddressDeny", "any"))
        out.append(("Socket", "IPAddressAllow", " ".join(provider.allow)))
    return out


def front_assignments(provider: Provider) -> list[Assignment]:
    out = _unit(provider, "front")
    env = environment_assignment("PROVIDERD_MANIFEST", str(provider.source))
    lines = [("Environment", env)]
    lines.append(("TimeoutStopSec", _seconds(provider.stop_timeout_s + FRONT_STOP_MARGIN_S)))
    if provider.network == "host":
        lines.append(("PrivateNetwork", "no"))
    if provider.uses_gpu:
        # NVML for placement and budgets; the front runs no CUDA.
        lines += [
            ("PrivateDevices", "no"),
            ("DeviceAllow", "/dev/nvidiactl rw"),
            ("DeviceAllow", "char-nvidia rw"),
        ]
    return out + [("Service", k, v) for k, v in lines]


def worker_assignments(provider: Provider, python: str = PYTHON) -> list[Assignment]:
    out = _unit(provider, "worker")
    if provider.starts_with_front:
        # Nothing to decide at run time: systemd starts the worker on the front's own
        # activation (the front Wants= it), unless the front's backoff after a failed
        # start is running (it keeps that in a file between activations), or API keys are
        # on: then a connection without a key must not start the model, and the front
        # starts it (worker.env first) once a request may.
        out += [
            ("Unit", "ConditionPathExists", ""),
            ("Unit", "ConditionPathExists", f"!{BACKOFF_FILE}"),
            ("Unit", "ConditionPathExists", f"|!{KEYS_FILE}"),
            ("Unit", "ConditionPathExists", f"|{WORKER_ENV_FILE}"),
        ]
    lines = [("ExecStart", ""), ("ExecStart", exec_line(worker_argv(provider, python)))]
    if provider.known_worker_port:
        port = str(provider.known_worker_port)
        lines.append(("Environment", environment_assignment("PROVIDERD_WORKER_PORT", port)))
    if provider.network == "host":  # also when systemd starts it beside the front
        host = worker_loopback(provider.slug)
        lines.append(("Environment", environment_assignment("PROVIDERD_WORKER_HOST", host)))
    lines += [("Environment", environment_assignment(k, v)) for k, v in provider.environment]
    if provider.working_directory:
        lines.append(("WorkingDirectory", escape_specifiers(provider.working_directory)))
        if _below(provider.working_directory, HIDDEN_FROM_WORKER):
            lines.append(("BindReadOnlyPaths", escape_specifiers(provider.working_directory)))
    lines += [
        ("LoadCredential", f"{name}:{escape_specifiers(path)}")
        for name, path in provider.credentials
    ]
    lines.append(("TimeoutStartSec", _seconds(provider.start_timeout_s)))
    if provider.memory_max is not None:
        lines.append(("MemoryMax", format_size(provider.memory_max)))
    if provider.memory_high is not None:
        lines.append(("MemoryHigh", format_size(provider.memory_high)))
    if provider.cpu_quota is not None:
        lines.append(("CPUQuota", f"{provider.cpu_quota}%"))
    if provider.tasks_max is not None:
        lines.append(("TasksMax", str(provider.tasks_max)))
    lines += [("BindReadOnlyPaths", escape_specifiers(p)) for p in provider.weight_paths]
    if provider.uses_gpu:
        # Shared by every card; the card itself (/dev/nvidiaN) is allowed by the front at each start.
        lines += [("DeviceAllow", "/dev/nvidiactl rw"), ("DeviceAllow", "char-nvidia-uvm rw")]
    if provider.network == "host":
        # Any address but the other loopback ones (other fronts, the router): see
        # docs/security.md for what a host-network worker gives up.
        own = worker_loopback(provider.slug)
        lines += [("PrivateNetwork", "no"), ("IPAddressDeny", ""), ("IPAddressDeny", "localhost")]
        lines += [("IPAddressAllow", ""), ("IPAddressAllow", f"{own}/32")]
    return out + [("Service", k, v) for k, v in lines]


def _below(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == r or path.startswith(r + "/") for r in roots)


def render_socket(provider: Provider) -> str:
    return dropin_text(_head(provider), socket_assignments(provider))


def render_front(provider: Provider) -> str:
    return dropin_text(_head(provider), front_assignments(provider))


def render_worker(provider: Provider, python: str = PYTHON) -> str:
    return dropin_text(_head(provider), worker_assignments(provider, python))


def intended(provider: Provider, python: str = PYTHON) -> dict[str, list[Assignment]]:
    """What each drop-in of `render` says, as (section, directive, value) in order:
    reading the file back the way systemd does must give exactly this."""
    slug = provider.slug
    return {
        f"{socket_unit(slug)}.d/{DROPIN}": socket_assignments(provider),
        f"{front_unit(slug)}.d/{DROPIN}": front_assignments(provider),
        f"{worker_unit(slug)}.d/{DROPIN}": worker_assignments(provider, python),
    }


def render(provider: Provider, python: str = PYTHON) -> dict[str, str | Link]:
    """Every file the generator writes for one provider, by path relative to its output dir.
    Raises Unrenderable for a value that a unit file would not carry as it is."""
    try:
        hash(provider)
    except TypeError:  # a Provider built with a list somewhere: render it afresh
        return dict(_render.__wrapped__(provider, python))
    return dict(_render(provider, python))


@functools.lru_cache(maxsize=1 << 15)  # validation renders each provider once, the generator again
def _render(provider: Provider, python: str) -> dict[str, str | Link]:
    slug = provider.slug
    files: dict[str, str | Link] = {
        f"{socket_unit(slug)}.d/{DROPIN}": render_socket(provider),
        f"{front_unit(slug)}.d/{DROPIN}": render_front(provider),
        f"{worker_unit(slug)}.d/{DROPIN}": render_worker(provider, python),
    }
    if provider.enabled:
        files[f"sockets.target.wants/{socket_unit(slug)}"] = Link(SOCKET_TEMPLATE)
    if provider.enabled and provider.preload:
        # The front at boot: it Requires= and is After= its socket, reports READY at once
        # (the boot does not wait for the model) and starts the worker as on any activation.
        files[f"multi-user.target.wants/{front_unit(slug)}"] = Link(FRONT_TEMPLATE)
    return files


def _digest(files: dict[str, str | Link]) -> str:
    h = hashlib.sha256()
    for path, content in sorted(files.items()):
        text = f"-> {content.target}" if isinstance(content, Link) else content
        h.update(f"{path}\0{text}\0".encode())
    return h.hexdigest()[:16]


def digest(provider: Provider, python: str = PYTHON) -> str:
    """A fingerprint of everything generated for one provider."""
    return _digest(render(provider, python))


def _index_entry(p: Provider, fingerprint: str) -> dict[str, object]:
    return {
        "source": str(p.source),
        "addresses": [str(a) for a in p.addresses],
        "enabled": p.enabled,
        "digest": fingerprint,
    }


def render_index(providers: list[Provider], python: str = PYTHON) -> str:
    """`providerd.json`: what was generated, for `providerctl reload` to compare against."""
    entries = {p.slug: _index_entry(p, digest(p, python)) for p in providers}
    return json.dumps({"providers": entries}, indent=2, sort_keys=True) + "\n"


ROUTER_SERVICE = "providerd-router.service"


def render_router_allow(providers: list[Provider]) -> dict[str, str | Link]:
    """The router may connect to loopback only (its static unit); a provider listening on
    another address of this host adds that address to its allow-list."""
    hosts: set[str] = set()
    for p in providers:
        for a in p.addresses:
            if a.host is None:
                continue
            ip = ipaddress.ip_address(a.host.partition("%")[0])
            if not (ip.is_loopback or ip.is_unspecified):
                hosts.add(str(ip))
    if not hosts:
        return {}
    head = f"{GENERATOR}: the providers' addresses the router may connect to"
    allow = [("Service", "IPAddressAllow", " ".join(sorted(hosts)))]
    return {
        f"{ROUTER_SERVICE}.d/{DROPIN}": dropin_text(f"Automatically generated by {head}", allow)
    }


def render_all(providers: list[Provider], python: str = PYTHON) -> dict[str, str | Link]:
    """All providers' files plus the index, sorted by path."""
    files: dict[str, str | Link] = {**render_router_allow(providers)}
    entries: dict[str, object] = {}
    for p in providers:
        mine = render(p, python)
        files.update(mine)
        entries[p.slug] = _index_entry(p, _digest(mine))
    files[INDEX] = json.dumps({"providers": entries}, indent=2, sort_keys=True) + "\n"
    return dict(sorted(files.items()))
