"""`provider.toml` → `Provider`, or every problem in it.

`validate` is pure: a parsed TOML table in, a `Provider` or a list of `Problem`s
out, with the host facts it needs (CPU count, which paths exist) passed in. Each
value goes through its key kind's converter in `agent.spec.values`.
`parse_file`, `discover`, `check_paths` and `load` read files and check owners
and modes (`providerctl check` is agent.cli.check).

Kept light on imports: the generator parses every manifest at each boot and
`daemon-reload`.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from agent.errors import ProviderdError
from agent.spec import paths
from agent.spec.cross_check import cross_check
from agent.spec.files import FileProblem, contained, parse_trusted
from agent.spec.keys import BY_DOTTED, KEYS, SECTIONS, Key
from agent.spec.provider import Problem, Provider
from agent.spec.toml_strict import Invalid, did_you_mean, load_toml, quote, unknown_table
from agent.spec.values import CONVERTERS, Host, this_host

SLUG_RE = re.compile(r"[a-z0-9_]{1,48}")
SLUG_RULE = "lowercase letters, digits and '_' only, at most 48 characters"
DIR_MANIFEST = "provider.toml"
MAX_MANIFEST_BYTES = 1 << 20


class ManifestError(ProviderdError):
    """A manifest could not be used; `problems` says why, one line each."""

    code = "invalid_manifest"

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__(
            "\n".join(str(p) for p in problems), hint="'providerctl check' lists every problem"
        )
        self.problems = problems


@dataclass
class Discovery:
    providers: dict[str, Provider] = field(default_factory=dict)  # valid ones, sorted by slug
    problems: list[Problem] = field(default_factory=list)


# The Provider field each key fills.
_FIELDS = {
    "listen.address": "addresses",
    "runtime.ready": "ready",
    "gpu.devices": "gpu_devices",
    "gpu.count": "gpu_count",
    "gpu.priority": "gpu_priority",
    "weights.paths": "weight_paths",
    "models.names": "model_names",
    "models.patterns": "model_patterns",
}


def _field(key: Key) -> str:
    return _FIELDS.get(key.dotted, key.name)


def _did_you_mean(section: str, name: str) -> str:
    here = did_you_mean(name, [k.name for k in KEYS if k.section == section])
    if here:
        return here
    elsewhere = [k.dotted for k in KEYS if k.name == name]
    if elsewhere:
        return f' (did you mean "{elsewhere[0]}"?)'
    return did_you_mean(name, [k.name for k in KEYS], 0.8, lambda n: BY_KEYNAME[n].dotted)


BY_KEYNAME = {k.name: k for k in KEYS}


# -- the pure validator ------------------------------------------------------------------


def check_slug(slug: str) -> str | None:
    """None when `slug` is usable, else the message saying why not."""
    if SLUG_RE.fullmatch(slug):
        return None
    return f'"{slug}" is not a valid provider name: {SLUG_RULE} (a "-" would nest systemd slices)'


def validate(data: dict[str, Any], slug: str, source: Path, host: Host) -> Provider | list[Problem]:
    """A parsed manifest → `Provider`, or every problem found, in file order."""
    file = str(source)
    problems: list[Problem] = []

    def problem(key: str, message: str) -> None:
        problems.append(Problem(file, key, message))

    if (msg := check_slug(slug)) is not None:
        problem("", msg)

    values: dict[str, Any] = {}
    present: set[str] = set()
    broken: set[str] = set()  # tables that are not tables

    def take(section: str, name: str, value: object) -> None:
        dotted = f"{section}.{name}" if section else name
        key = BY_DOTTED.get(dotted)
        if key is None:
            problem(dotted, "unknown key" + _did_you_mean(section, name))
            return
        try:
            values[_field(key)] = CONVERTERS[key.kind](value, key, host)
            present.add(dotted)
        except Invalid as e:
            problem(dotted, str(e))

    tables: set[str] = set()
    for name, value in data.items():  # in file order, so problems are too
        if name in SECTIONS and name:
            if not isinstance(value, dict):
                problem(name, f"expected a table [{name}], got {quote(value)}")
                broken.add(name)
                continue
            tables.add(name)
            for sub, v in value.items():
                take(name, sub, v)
        elif isinstance(value, dict) and name not in BY_DOTTED:
            problem(name, unknown_table(name, [s for s in SECTIONS if s]))
        else:
            take("", name, value)

    for key in KEYS:
        reported = any(p.key == key.dotted for p in problems)
        if (
            key.required
            and key.dotted not in present
            and not reported
            and key.section not in broken
        ):
            problem(key.dotted, 'required key is missing (an address such as "127.0.0.1:8008")')

    # Relations between keys.
    has_command = "runtime.command" in present or any(p.key == "runtime.command" for p in problems)
    has_launch = "runtime.launch" in present or any(p.key == "runtime.launch" for p in problems)
    if has_command and has_launch:
        problem("runtime.launch", '"command" and "launch" are both set; keep one of them')
    elif not has_command and not has_launch:
        problem(
            "runtime", 'one of "command" (argv) or "launch" ("package.module:function") is required'
        )
    env_names = {name for name, _ in values.get("environment", ())}
    for name, _ in values.get("credentials", ()):
        if name in env_names:
            problem(
                "runtime.credentials",
                f"{name} is also in runtime.environment; a secret belongs in credentials only",
            )
    mh, mm = values.get("memory_high"), values.get("memory_max")
    if mh is not None and mm is not None and mh > mm:
        problem("limits.memory_high", "must not be larger than limits.memory_max")
    if "gpu" in tables:
        values.setdefault("gpu_devices", "auto")
    devices = values.get("gpu_devices", "none")
    count = values.get("gpu_count", 1)
    if isinstance(devices, tuple) and count > len(devices):
        problem("gpu.count", f"is {count} but gpu.devices lists only {len(devices)} device(s)")
    if devices == "none" and any(
        k in present for k in ("gpu.vram_budget_gb", "gpu.count", "gpu.priority")
    ):
        problem(
            "gpu.devices", 'is "none" but other [gpu] keys are set; remove them or choose devices'
        )
    if values.get("preload") and values.get("enabled") is False:
        problem(
            "runtime.preload",
            "is true but enabled = false: a provider whose socket is not started at boot "
            "is not loaded at boot either; set enabled = true or remove preload",
        )
    if problems:
        return problems
    if "working_directory" not in values and source.name == DIR_MANIFEST:
        values["working_directory"] = str(source.parent)
    return Provider(slug=slug, source=source, **values)


# -- files ---------------------------------------------------------------------------------


def slug_of(path: Path) -> str:
    """The slug a manifest path declares: `<slug>.toml` or `<slug>/provider.toml`."""
    if path.name == DIR_MANIFEST:
        return path.parent.name
    return path.name[: -len(".toml")] if path.name.endswith(".toml") else path.name


MANIFESTS_RUN_COMMANDS = "manifests run commands on the host"


def ownership_checks(path: Path) -> list[tuple[Path, bool]]:
    """The file, its `<slug>/` directory if any, and the manifest directory holding them."""
    checks = [(path, False), (path.parent, True)]
    if path.name == DIR_MANIFEST:
        checks.append((path.parent.parent, True))
    return checks


# A last check of a valid provider by a layer above (agent.systemd.manifests: that its units
# can be written): the problem's message, or None.
Check = Callable[[Provider], str | None]


def parse_bytes(
    raw: bytes, path: Path, slug: str, host: Host, check: Check | None = None
) -> Provider | list[Problem]:
    """Validate the bytes of one manifest, then `check` the provider if given."""
    file = str(path)
    try:
        data = load_toml(raw, "a manifest")
    except Invalid as e:
        return [Problem(file, "", str(e))]
    result = validate(data, slug, path, host)
    message = check(result) if isinstance(result, Provider) and check is not None else None
    if message is not None:
        return [Problem(file, "", message)]
    return result


def _parse_file(
    path: Path, slug: str | None, host: Host | None, check: Check | None
) -> Provider | list[Problem]:
    path = Path(os.path.abspath(path))
    slug = slug if slug is not None else slug_of(path)
    checks = ownership_checks(path)
    try:
        return parse_trusted(
            path,
            MAX_MANIFEST_BYTES,
            "manifest",
            checks,
            MANIFESTS_RUN_COMMANDS,
            lambda raw: parse_bytes(raw, path, slug, host or this_host(), check),
        )
    except FileProblem as e:
        return [Problem(str(path), "", e.message)]


def parse_file(
    path: Path, slug: str | None = None, host: Host | None = None, check: Check | None = None
) -> Provider | list[Problem]:
    """Read, check owner and mode, and validate one manifest file: the boundary of one
    file, so whatever it holds or is comes back as its problems, never as an exception."""
    return contained(str(path), "manifest", lambda: _parse_file(path, slug, host, check))


# -- discovery and the checks across manifests --------------------------------------------


def _candidate(e: os.DirEntry[str]) -> tuple[str, Path] | None:
    if e.name.startswith("."):
        return None
    if e.name.endswith(".toml"):
        return e.name[: -len(".toml")], Path(e.path)
    try:
        if e.is_dir() and os.path.lexists(os.path.join(e.path, DIR_MANIFEST)):
            return e.name, Path(e.path) / DIR_MANIFEST
    except OSError:
        pass  # a symlink loop, say: not a manifest (a `.toml` name is checked as one)
    return None


def _candidates(directory: Path, problems: list[Problem]) -> list[tuple[str, Path]]:
    """(slug, manifest path) for every entry that looks like a manifest, sorted. A
    directory that exists but cannot be listed is a problem (in `problems`)."""
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except OSError as e:
        if e.errno not in (errno.ENOENT, errno.ENOTDIR):
            problems.append(
                Problem(str(directory), "", f"Failed to list manifests: {e.strerror or e}")
            )
        return []
    return [c for c in map(_candidate, entries) if c is not None]


def _finish(found: list[Provider], problems: list[Problem]) -> Discovery:
    cross = cross_check(found)
    bad = {p.file for p in cross}
    providers = {p.slug: p for p in sorted(found, key=lambda p: p.slug) if str(p.source) not in bad}
    return Discovery(providers, problems + cross)


def _read_one(
    slug: str,
    manifests: list[Path],
    host: Host,
    check: Check | None,
    found: list[Provider],
    problems: list[Problem],
) -> None:
    """The manifest of one slug into `found`, or its problems; two files that declare one
    slug are a problem of each."""
    if len(manifests) > 1:
        for m in manifests:
            others = ", ".join(str(o) for o in manifests if o != m)
            problems.append(
                Problem(str(m), "", f'provider "{slug}" is also declared by {others}; keep one')
            )
        return
    result = parse_file(manifests[0], slug, host, check)
    if isinstance(result, list):
        problems.extend(result)
    else:
        found.append(result)


def _scan(
    dirs: Iterable[Path], host: Host, check: Check | None
) -> tuple[list[Provider], list[Problem]]:
    found: list[Provider] = []
    problems: list[Problem] = []
    seen: set[str] = set()
    for directory in dirs:
        by_slug: dict[str, list[Path]] = {}
        for slug, path in _candidates(directory, problems):
            by_slug.setdefault(slug, []).append(path)
        for slug, manifests in by_slug.items():
            if slug in seen:
                continue  # a higher-priority directory declares it
            seen.add(slug)
            _read_one(slug, sorted(manifests, key=str), host, check, found, problems)
    return found, problems


def discover(
    dirs: list[Path] | None = None, host: Host | None = None, check: Check | None = None
) -> Discovery:
    """Every manifest in the manifest directories (highest priority first)."""
    dirs = paths.manifest_dirs() if dirs is None else dirs
    found, problems = _scan(dirs, host or this_host(), check)
    return _finish(found, problems)


def check_paths(
    items: list[Path], host: Host | None = None, check: Check | None = None
) -> Discovery:
    """`providerctl check PATH...`: files, `<slug>/` directories or manifest directories."""
    host = host or this_host()
    problems: list[Problem] = []
    manifests: list[Path] = []
    for item in items:
        item = Path(os.path.abspath(item))
        try:
            if item.is_dir() and not item.name.endswith(".toml"):
                if os.path.lexists(item / DIR_MANIFEST):
                    manifests.append(item / DIR_MANIFEST)
                else:
                    manifests += [path for _, path in _candidates(item, problems)]
            elif os.path.lexists(item):
                manifests.append(item)
            else:
                problems.append(Problem(str(item), "", "No such file or directory"))
        except OSError as e:
            problems.append(Problem(str(item), "", f"Failed to read: {e.strerror or e}"))
    by_slug: dict[str, list[Path]] = {}
    for path in dict.fromkeys(manifests):  # each file once, in the order given
        by_slug.setdefault(slug_of(path), []).append(path)
    found: list[Provider] = []
    for slug, paths_ in by_slug.items():
        _read_one(slug, paths_, host, check, found, problems)
    return _finish(found, problems)


def load(slug: str, check: Check | None = None) -> Provider:
    """The manifest of one provider, for the front at start. Raises ManifestError."""
    env = os.environ.get("PROVIDERD_MANIFEST")
    if env:
        result = parse_file(Path(env), slug, check=check)
        if isinstance(result, list):
            raise ManifestError(result)
        return result
    found = discover(check=check)
    if slug in found.providers:
        return found.providers[slug]
    mine = [p for p in found.problems if slug_of(Path(p.file)) == slug]
    if mine:
        raise ManifestError(mine)
    where = ", ".join(str(d) for d in paths.manifest_dirs())
    raise ManifestError([Problem(slug, "", f'no manifest for provider "{slug}" in {where}')])


def with_source(provider: Provider, source: Path) -> Provider:
    """The same provider as if read from `source` (golden tests use fixed paths)."""
    return replace(provider, source=source)
