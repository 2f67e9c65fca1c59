"""What the front's early start needs of one provider, written by the generator beside the
units it renders, and read back only while the files it came from are unchanged.

The generator runs as root at every daemon-reload and has just validated each manifest
(`agent.systemd.manifests`). For a provider whose worker's start the front decides, it
writes `<generator dir>/providerd-early/<slug>`: the decision's inputs (the worker's port
and address, the GPU request, providerd.toml's GPU headroom) and the stat of every file
they came from: the manifest, the directories whose owner and mode its validation checks
(`agent.spec.manifest.ownership_checks`), and providerd.toml; and what else the manifest's
validation found on this machine: that each weights path exists, and the CPU count (a CPU
quota is checked against it). The early start
(`agent.front.early`) takes the record instead of validating the manifest again, which
costs the imports of most of `agent.spec` on the way to the worker's StartUnit; the front
validates the manifest in full after that StartUnit either way.

`read()` gives None, and the early start validates the manifest itself, whenever the record
may not say what the manifest says: no record; a record not owned by root or writable by
group or others; another manifest path; any of those files with another device, inode,
size, mtime or ctime than when it was written (an edit, a replacement, a chmod or a chown
changes one of them), or a file then absent that exists now; a weights path gone; another
CPU count; anything else unexpected in it. Its format is lines of `key value`, so reading it needs no parser module.

Kept light: only `os` (and `agent.spec.locations`) at import, since it runs before most of the standard library is
loaded.
"""

from __future__ import annotations

import os

from agent.spec import locations

TYPE_CHECKING = False  # not typing's: its import costs milliseconds (mypy reads this as it)
if TYPE_CHECKING:
    from agent.spec.provider import Provider

GENERATOR_DIR = "/run/systemd/generator"
DIRECTORY = "providerd-early"
MAGIC = "providerd-early 2"
MAX_BYTES = 16384
# A file whose mtime or ctime is this close to the snapshot (or after it) may be written
# again within the filesystem's timestamp granularity, with the same size, and match its
# old stat: no record watches it ("racy clean"); that reload's starts read the manifest.
RACY_NS = 1_000_000_000
_FIELDS = ("slug", "manifest", "port", "host", "gpu", "gpu_count", "vram_budget_gb", "cpus")
_OPTIONAL = ("gpu_priority", "headroom")


def generator_dir() -> str:
    """Where systemd's generators write (moved by PROVIDERD_GENERATOR_DIR for tests)."""
    return os.environ.get("PROVIDERD_GENERATOR_DIR", GENERATOR_DIR)


def record_path(slug: str, directory: str | None = None) -> str:
    return os.path.join(directory or generator_dir(), DIRECTORY, slug)


def _stat_line(path: str, settled_ns: int) -> str | None:
    """`stat …` or `absent …`; None for a file that cannot be watched: one that cannot be
    looked at (a symlink loop, say), or changed at `settled_ns` or after (`RACY_NS`)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return f"absent {path}"
    except OSError:
        return None
    if max(st.st_mtime_ns, st.st_ctime_ns) >= settled_ns:
        return None  # racy: a rewrite of the same size within the same tick would match
    return f"stat {st.st_dev} {st.st_ino} {st.st_size} {st.st_mtime_ns} {st.st_ctime_ns} {path}"


def snapshot(manifest_dirs: list[str]) -> dict[str, str]:
    """The stat lines of the files a record may watch (the manifest directories, what is in
    them, a `<slug>/provider.toml`), taken before the manifests are read, so that a file
    changed while the generator runs never matches its record. A file changed within
    `RACY_NS` of now is left out: no record watches it."""
    import time

    from agent.spec import paths
    from agent.spec.manifest import DIR_MANIFEST

    taken: dict[str, str] = {}
    settled = time.time_ns() - RACY_NS

    def take(path: str) -> None:
        line = _stat_line(path, settled)
        if line is not None:
            taken[path] = line

    take(os.path.abspath(paths.config_file()))
    for directory in map(os.path.abspath, manifest_dirs):
        take(directory)
        try:
            names = sorted(os.listdir(directory))
        except OSError:
            continue
        for name in names:
            path = os.path.join(directory, name)
            take(path)
            if os.path.isdir(path):
                take(os.path.join(path, DIR_MANIFEST))
    return taken


def render(
    provider: Provider, config: str, headroom_bytes: int | None, taken: dict[str, str]
) -> str | None:
    """The record of a provider whose start the front decides; None for one systemd starts
    beside its front, one whose files' stat was not `taken` (`snapshot`), or whose paths
    would not fit on a line. `config`: providerd.toml's path; `headroom_bytes`: its GPU
    headroom, None when it could not be read (the early start then reads it, and says
    what is wrong with it)."""
    from pathlib import Path

    from agent.spec.manifest import ownership_checks
    from agent.systemd.units import worker_host

    if provider.starts_with_front:
        return None
    manifest = os.path.abspath(provider.source)
    watched = [str(p) for p, _ in ownership_checks(Path(manifest))] + [os.path.abspath(config)]
    if any("\n" in p or "\r" in p or p not in taken for p in [manifest, *watched]):
        return None
    devices = provider.gpu_devices
    gpu = devices if isinstance(devices, str) else "list " + " ".join(str(d) for d in devices)
    budget = "-" if provider.vram_budget_gb is None else repr(float(provider.vram_budget_gb))
    lines = [
        MAGIC,
        f"slug {provider.slug}",
        f"manifest {manifest}",
        f"port {provider.known_worker_port}",
        f"host {worker_host(provider)}",
        f"gpu {gpu}",
        f"gpu_count {provider.gpu_count}",
        f"gpu_priority {provider.gpu_priority}",
        f"vram_budget_gb {budget}",
    ]
    if headroom_bytes is not None:
        lines.append(f"headroom {headroom_bytes}")
    lines += [taken[p] for p in watched]
    # What else validation checked on this machine (agent.spec.values.this_host).
    lines += [f"exists {p}" for p in provider.weight_paths]
    lines.append(f"cpus {_cpus()}")
    return "\n".join(lines) + "\n"


def _cpus() -> int:
    return os.cpu_count() or 1  # as agent.spec.values.this_host


def _text(path: str) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if (st.st_mode & 0o170000) != 0o100000 or st.st_uid not in locations.trusted_uids():
            return None
        if st.st_mode & 0o022 or st.st_size > MAX_BYTES:
            return None
        return os.read(fd, MAX_BYTES + 1).decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    finally:
        os.close(fd)


def _unchanged(line: str) -> bool:
    kind, _, rest = line.partition(" ")
    if kind == "absent":
        return not os.path.lexists(rest)
    parts = rest.split(" ", 5)
    if kind != "stat" or len(parts) != 6:
        return False
    try:
        st = os.stat(parts[5])
    except OSError:
        return False
    now = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    return tuple(str(n) for n in now) == tuple(parts[:5])


def read(slug: str, manifest: str, directory: str | None = None) -> dict[str, str] | None:
    """The record's fields (`slug`, `manifest`, `port`, `host`, `gpu`, `gpu_count`,
    `vram_budget_gb`, `cpus`, and `gpu_priority`, `headroom` where written) when it is root's,
    for `manifest`, and every file it came from is as it was; else None."""
    text = _text(record_path(slug, directory))
    if text is None or not text.endswith("\n"):
        return None
    lines = text[:-1].split("\n")
    if lines[0] != MAGIC:
        return None
    fields: dict[str, str] = {}
    watched = 0
    for line in lines[1:]:
        key, _, value = line.partition(" ")
        if key in ("stat", "absent"):
            if not _unchanged(line):
                return None
            watched += 1
        elif key == "exists":
            if not os.path.exists(value):
                return None  # a weights path gone: the manifest no longer validates
        elif key == "cpus":
            if value != str(_cpus()):
                return None  # a CPU quota may no longer fit
            fields[key] = value
        elif key in _FIELDS or key in _OPTIONAL:
            fields[key] = value
        else:
            return None
    if any(k not in fields for k in _FIELDS) or watched < 3:
        return None  # the manifest, its directory and providerd.toml at least
    if fields["slug"] != slug or fields["manifest"] != os.path.abspath(manifest):
        return None
    return fields
