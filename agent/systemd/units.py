"""`Provider` → the generator's files. Pure: no I/O.

The unit logic lives in the static templates under `units/`; per provider the
generator writes only drop-ins (`50-manifest.conf`) and, for enabled providers,
a `sockets.target.wants/` link (and a `multi-user.target.wants/` link to the
front for those that preload). `render` returns them as a mapping from a path
relative to the generator's output directory to the file's text or a `Link`.

Each directive a manifest key becomes is named by the key table (`spec.keys`,
`Key.becomes`); the quoting is `systemd.quoting`'s and the unit names `systemd.names`'.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable

from agent.spec.keys import becomes
from agent.spec.placeholders import fill_placeholders, placeholder_values
from agent.spec.provider import Provider
from agent.spec.sizes import format_size
from agent.systemd import router_units
from agent.systemd.names import (
    DROPIN,
    FRONT_TEMPLATE,
    GENERATOR,
    ROUTER_SERVICE,
    SOCKET_TEMPLATE,
    UNIT_DIR,
    front_unit,
    socket_unit,
    worker_unit,
)
from agent.systemd.quoting import (
    VARIABLE,
    Assignment,
    Link,
    Unrenderable,
    assignment,
    comment,
    dropin_text,
    environment_assignment,
    escape_specifiers,
    exec_line,
    exec_word,
    one_line,
    seconds,
)

__all__ = [  # re-exported: other modules take these names and the quoting from here
    "DROPIN",
    "GENERATOR",
    "ROUTER_SERVICE",
    "UNIT_DIR",
    "Assignment",
    "Link",
    "Unrenderable",
    "assignment",
    "comment",
    "environment_assignment",
    "exec_line",
    "exec_word",
    "format_size",
    "front_unit",
    "socket_unit",
    "worker_unit",
]

PYTHON = "/usr/bin/python3"
INDEX = "providerd.json"
# agent.spec.paths.backoff_file() at its default place, as a unit specifier.
BACKOFF_FILE = "/run/providerd/%i.backoff"
KEYS_FILE = "/etc/providerd/keys.toml"  # paths.KEYS: its existence turns API keys on
WORKER_ENV_FILE = "/run/providerd/%i/worker.env"  # written by the front before its own start
FRONT_AFTER_WORKER = "provider-worker@%i.service"
# Where /etc/resolv.conf points on systems whose resolver manages it (systemd-resolved,
# NetworkManager, resolvconf), under the /run a worker does not see.
RESOLVER_FILES = ("/run/systemd/resolve", "/run/NetworkManager/resolv.conf", "/run/resolvconf")
FRONT_STOP_MARGIN_S = 30  # the front's TimeoutStopSec= is stop_timeout_s plus this
# Hidden from every worker by TemporaryFileSystem= in units/provider-worker@.service (other
# providers' manifests); a working directory below them is bound back in read-only.
HIDDEN_FROM_WORKER = ("/etc/providerd", "/usr/lib/providerd", "/run")

# The directive each manifest key becomes, as the key table says (tests/unit/test_keys_render.py
# renders every key and checks it lands there).
(LISTEN_STREAM,) = becomes("listen.address", "socket")
IP_DENY, IP_ALLOW = becomes("listen.allow", "socket")
(SOCKET_MODE,) = becomes("listen.socket_mode", "socket")
(SOCKET_GROUP,) = becomes("listen.socket_group", "socket")
(SOCKETS_WANTS,) = becomes("enabled", "link")
(BOOT_WANTS,) = becomes("runtime.preload", "link")
(FRONT_STOP_TIMEOUT,) = becomes("runtime.stop_timeout_s", "front")
(FRONT_PRIVATE_NETWORK,) = becomes("isolation.network", "front")
(EXEC_START,) = becomes("runtime.command", "worker")
(ENVIRONMENT,) = becomes("runtime.environment", "worker")
(WORKING_DIRECTORY,) = becomes("runtime.working_directory", "worker")
(LOAD_CREDENTIAL,) = becomes("runtime.credentials", "worker")
(START_TIMEOUT,) = becomes("runtime.start_timeout_s", "worker")
(MEMORY_MAX,) = becomes("limits.memory_max", "worker")
(MEMORY_HIGH,) = becomes("limits.memory_high", "worker")
(CPU_QUOTA,) = becomes("limits.cpu_quota", "worker")
(TASKS_MAX,) = becomes("limits.tasks_max", "worker")
(WEIGHTS,) = becomes("weights.paths", "worker")
(GPU_DEVICES,) = becomes("gpu.devices", "worker")
(WORKER_PRIVATE_NETWORK,) = becomes("isolation.network", "worker")


# -- the worker wrapper --------------------------------------------------------------------


def worker_loopback(slug: str) -> str:
    """A host-network worker's own loopback address, 127.A.B.C with A >= 1 (never
    127.0.0.1, where the fronts and the router listen): the worker may use no other
    loopback address (IPAddressDeny=localhost, IPAddressAllow= this), and its front
    connects from it."""
    h = hashlib.sha256(slug.encode()).digest()
    return f"127.{1 + h[0] % 254}.{h[1]}.{1 + h[2] % 254}"


def worker_host(provider: Provider) -> str:
    """The address the model listens on: 127.0.0.1 in the provider's own network
    namespace, its own loopback address on the host network."""
    return worker_loopback(provider.slug) if provider.network == "host" else "127.0.0.1"


def worker_argv(provider: Provider, python: str = PYTHON) -> list[str]:
    """The worker wrapper's command line (parsed by `agent.worker.wrapper`)."""
    argv = [python, "-m", "agent.worker", "--slug", provider.slug, "--ready", str(provider.ready)]
    for name, _ in provider.credentials:
        argv += ["--credential", name]
    if provider.launch:
        return [*argv, "--launch", provider.launch]
    return [*argv, "--", *provider.command]


def runs_model_directly(provider: Provider) -> bool:
    """Whether the worker unit's main process is the model itself: a plain command whose
    program is an absolute path, with no credential to turn into a variable (what only the
    wrapper does; it also finds a bare program name on the unit's own PATH=, as systemd's
    ExecStart= does not). The front probes the model (`tcp`, `http:`) or the model says
    READY=1 (`notify`); a wrapper would only cost an interpreter's start on the way to every
    cold start."""
    if provider.launch or provider.credentials or not provider.command:
        return False
    program = provider.command[0]
    return program.startswith("/") or program.startswith("{python}")


def model_command(provider: Provider, python: str = PYTHON) -> str:
    """The model's command for ExecStart=, its placeholders filled when the generator runs:
    the host and the port are known then, but for a port the front picks at each start,
    left to systemd as ${PROVIDERD_WORKER_PORT} (from worker.env)."""
    port = provider.known_worker_port
    values = placeholder_values(
        port=str(port) if port else VARIABLE,
        host=worker_host(provider),
        slug=provider.slug,
        python=python,
    )
    argv = [fill_placeholders(arg, values) for arg in provider.command]
    return exec_line(argv, "PROVIDERD_WORKER_PORT")


def worker_type(provider: Provider) -> str:
    """The worker's Type=: started once its READY=1 arrives (the wrapper's, or a `notify`
    model's own), else once the model's program runs (the front sees it answer)."""
    if not runs_model_directly(provider) or provider.ready.kind == "notify":
        return "notify"
    return "exec"


# -- drop-ins ------------------------------------------------------------------------------


def _head(provider: Provider) -> str:
    return f"Automatically generated by {GENERATOR} from {provider.source}"


def _unit(provider: Provider, role: str) -> list[Assignment]:
    what = f": {provider.description}" if provider.description else ""
    return [
        ("Unit", "SourcePath", escape_specifiers(str(provider.source))),
        ("Unit", "Description", f"Provider {provider.slug}{one_line(what)} ({role})"),
    ]


def socket_assignments(provider: Provider) -> list[Assignment]:
    out = _unit(provider, "listener")
    out += [("Socket", LISTEN_STREAM, escape_specifiers(str(a))) for a in provider.addresses]
    if any(a.is_unix for a in provider.addresses):
        out.append(("Socket", SOCKET_MODE, f"{provider.socket_mode:04o}"))
        out.append(("Socket", SOCKET_GROUP, escape_specifiers(provider.socket_group)))
    if provider.allow:
        out.append(("Socket", IP_DENY, "any"))
        out.append(("Socket", IP_ALLOW, " ".join(provider.allow)))
    return out


def front_after_worker(provider: Provider) -> bool:
    """Whether the front's unit is ordered after the worker's (After=). On the same
    activation, the worker's set-up then runs first: the front's own sandbox built beside
    it delayed the model's start by about 30 ms. Only for a Type=exec worker systemd starts
    beside the front: it is started once the model's program runs, and the front then
    starts while the model loads; a worker skipped by its conditions (keys on, a backoff
    running) does not hold the front back. The order reverses at a stop: when PID 1 stops
    the front, it stops the worker after it, so the front must not wait for that stop."""
    return provider.starts_with_front and worker_type(provider) == "exec"


def front_assignments(provider: Provider) -> list[Assignment]:
    out = _unit(provider, "front")
    if front_after_worker(provider):
        out.append(("Unit", "After", FRONT_AFTER_WORKER))
    env = environment_assignment("PROVIDERD_MANIFEST", str(provider.source))
    lines = [("Environment", env)]
    lines.append((FRONT_STOP_TIMEOUT, seconds(provider.stop_timeout_s + FRONT_STOP_MARGIN_S)))
    if provider.network == "host":
        lines.append((FRONT_PRIVATE_NETWORK, "no"))
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
    if runs_model_directly(provider):
        command = model_command(provider, python)
    else:
        command = exec_line(worker_argv(provider, python))
    lines = [] if worker_type(provider) == "notify" else [("Type", worker_type(provider))]
    lines += [(EXEC_START, ""), (EXEC_START, command)]
    if provider.known_worker_port:
        port = str(provider.known_worker_port)
        lines.append(("Environment", environment_assignment("PROVIDERD_WORKER_PORT", port)))
    if provider.network == "host":  # also when systemd starts it beside the front
        host = worker_loopback(provider.slug)
        lines.append(("Environment", environment_assignment("PROVIDERD_WORKER_HOST", host)))
    lines += [(ENVIRONMENT, environment_assignment(k, v)) for k, v in provider.environment]
    if provider.working_directory:
        lines.append((WORKING_DIRECTORY, escape_specifiers(provider.working_directory)))
        if _below(provider.working_directory, HIDDEN_FROM_WORKER):
            lines.append(("BindReadOnlyPaths", escape_specifiers(provider.working_directory)))
    lines += [
        (LOAD_CREDENTIAL, f"{name}:{escape_specifiers(path)}")
        for name, path in provider.credentials
    ]
    lines.append((START_TIMEOUT, seconds(provider.start_timeout_s)))
    if provider.memory_max is not None:
        lines.append((MEMORY_MAX, format_size(provider.memory_max)))
    if provider.memory_high is not None:
        lines.append((MEMORY_HIGH, format_size(provider.memory_high)))
    if provider.cpu_quota is not None:
        lines.append((CPU_QUOTA, f"{provider.cpu_quota}%"))
    if provider.tasks_max is not None:
        lines.append((TASKS_MAX, str(provider.tasks_max)))
    lines += [(WEIGHTS, escape_specifiers(p)) for p in provider.weight_paths]
    if provider.uses_gpu:
        # Shared by every card; the card itself (/dev/nvidiaN) is allowed by the front at each start.
        lines += [(GPU_DEVICES, "/dev/nvidiactl rw"), (GPU_DEVICES, "char-nvidia-uvm rw")]
    if provider.network == "host":
        # Any address but the other loopback ones (other fronts, the router): see
        # docs/security.md for what a host-network worker gives up.
        own = worker_loopback(provider.slug)
        lines += [
            (WORKER_PRIVATE_NETWORK, "no"),
            ("IPAddressDeny", ""),
            ("IPAddressDeny", "localhost"),
        ]
        lines += [("IPAddressAllow", ""), ("IPAddressAllow", f"{own}/32")]
        # It may reach other hosts, so it gets the resolver's files back from the /run it
        # does not see (where /etc/resolv.conf points on systems that manage it).
        lines.append(("BindReadOnlyPaths", " ".join(f"-{p}" for p in RESOLVER_FILES)))
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
    slug = provider.slug
    files: dict[str, str | Link] = {
        f"{socket_unit(slug)}.d/{DROPIN}": render_socket(provider),
        f"{front_unit(slug)}.d/{DROPIN}": render_front(provider),
        f"{worker_unit(slug)}.d/{DROPIN}": render_worker(provider, python),
    }
    if provider.enabled:
        files[f"{SOCKETS_WANTS}/{socket_unit(slug)}"] = Link(SOCKET_TEMPLATE)
    if provider.enabled and provider.preload:
        # The front at boot: it Requires= and is After= its socket, reports READY at once
        # (the boot does not wait for the model) and starts the worker as on any activation.
        files[f"{BOOT_WANTS}/{front_unit(slug)}"] = Link(FRONT_TEMPLATE)
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


def render_all(
    providers: list[Provider],
    python: str = PYTHON,
    rendered: Callable[[Provider], dict[str, str | Link] | None] = lambda p: None,
) -> dict[str, str | Link]:
    """All providers' files plus the index, sorted by path; `rendered(p)` gives those
    already rendered (with the default `python`), if any."""
    files: dict[str, str | Link] = {**router_units.render_router_allow(providers)}
    entries: dict[str, object] = {}
    for p in providers:
        mine = (rendered(p) if python == PYTHON else None) or render(p, python)
        files.update(mine)
        entries[p.slug] = _index_entry(p, _digest(mine))
    files[INDEX] = json.dumps({"providers": entries}, indent=2, sort_keys=True) + "\n"
    return dict(sorted(files.items()))
